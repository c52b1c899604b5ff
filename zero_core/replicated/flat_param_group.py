"""One optimizer group's trainable parameters of one dtype, living in one flat buffer.

Stages 1 and 2 keep every parameter whole: the parameters become views of ``flat`` (so the model runs
unchanged), and this rank's optimizer steps over its slices of each bucket. What differs by stage is only
where gradients live, and that is chosen here by ``full_grads``:
- stage 1 (``full_grads=True``): a flat gradient buffer as big as ``flat``; ``param.grad`` are views of it, so
  autograd accumulates in place and one reduce-scatter per bucket reads it directly.
- stage 2 (``full_grads=False``): only this rank's reduced gradient shard is kept; during backward
  ``param.grad`` is the parameter's slot in its bucket's staging buffer (from the bucket's first gradient to its
  launch, grad_reducer.py), and None outside backward. Except in the bucket reduced last, which works as stage
  1's: its slots stay its parameters' ``.grad``, and its gradient shard is lent (``lend_grad_shard``): this
  rank's slice of its kept staging buffer, reduced in place (last_bucket.py).

Stage 2 gives each bucket's gradient shard a storage of its own, so that one bucket's memory can go while the
others keep theirs: a lent bucket's own shard holds none while it is lent, and with ``offload_optimizer`` (device
cpu) a bucket's shard gives its memory back once its copy to the host is under way (grads_to_host), as stage 3's
units do (grad_memory.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from zero_core import grad_memory
from zero_core.fragments import Fragment
from zero_core.layout import BucketLayout, FlatLayout
from zero_core.optim.master_shards import MasterShards


class FlatParamGroup:
    """Flat parameter storage, gradient storage and fp32 master shards for one (group, dtype); a
    ``zero_core.contracts.Part``."""

    swap = None  # parameter shards are never swapped to NVMe at stages 1-2 (a stage 3 unit's may be)
    update_in_flight = None  # an overlapped offloaded step's handle until this group's shards hold its update
    reduced_whole = False  # its last reduced bucket had a gradient for every parameter here (grad_reducer.py)

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_index: int,
        layout: FlatLayout,
        rank: int,
        full_grads: bool,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group_index = group_index
        self.layout = layout
        self.rank = rank
        self.full_grads = full_grads
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        existing = [p.grad for p in self.params]  # made trainable after setup, a parameter may hold one already
        self.flat = self._adopt_params()
        self.flat_grad: Optional[torch.Tensor] = None
        self._grad_shards = self._allocate_grads()
        # Stage 2: buckets whose gradient shard was cleared but not zeroed yet (zero_grads); the step's first
        # reduction overwrites such a shard (take_grad_shard), any other access zeroes it first. A new shard holds
        # no gradient either: were it not stale, lend_grad_shard would take its zeros for a reduced gradient, and
        # give the lent slice's local gradients back as one when the reducer is replaced before the first step
        self._stale: set[int] = set() if full_grads else set(range(len(self._grad_shards)))
        self._lent: set[int] = set()  # buckets whose shard lend_grad_shard replaced (their own is _grad_own's)
        self._lent_reduced: set[int] = set()  # lent shards holding a reduced gradient (not local ones)
        self._moved: dict[int, grad_memory.MovedToHost] = {}  # stage 2: buckets offload moved to the host
        if self.full_grads:
            for param, grad in zip(self.params, existing):
                if grad is not None:
                    param.grad.copy_(grad)
            if grad_memory.releases(self.device) and all(grad is None for grad in existing):
                self.zero_grads()  # born as after a step: no memory until the first reduction (or read)
        self.master_shards: Optional[MasterShards] = None
        self.on_grad_reduced = None  # offload (zero_core/offload): called with (self, bucket) after each reduction

    # -- storage -------------------------------------------------------------------------------------------
    def _adopt_params(self) -> torch.Tensor:
        """Copy each parameter into the flat buffer and make it a view of it (same Parameter object)."""
        flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        for param, slot in zip(self.params, self.layout.slots):
            view = flat[slot.range.as_slice()].view_as(param)
            view.copy_(param.detach())
            param.data = view
        return flat

    def _allocate_grads(self) -> list[torch.Tensor]:
        if self.full_grads:
            self.flat_grad = torch.zeros_like(self.flat)
            # Each parameter's view of flat_grad, made once: the step and zero_grad re-point .grad at them.
            self._grad_views = [self.flat_grad[slot.range.as_slice()].view_as(param)
                                for param, slot in zip(self.params, self.layout.slots)]
            self._point_grads_at_views()
            return [self.flat_grad[b.shard_range(self.rank).as_slice()] for b in self.layout.buckets]
        # One storage per bucket: each bucket's memory can go and come back alone
        self._grad_own = [torch.empty(b.shard_size, dtype=self.dtype, device=self.device) for b in self.layout.buckets]
        for own in self._grad_own:
            if grad_memory.releases(self.device):  # every bucket starts stale: its first reduction allocates it
                grad_memory.release(own)
            else:
                own.zero_()
        return list(self._grad_own)

    def _point_grads_at_views(self) -> None:
        for param, view in zip(self.params, self._grad_views):
            if param.grad is not view:
                param.grad = view

    def build_masters(self, master_dtype: Optional[torch.dtype]) -> None:
        """fp32 master shards, one per bucket: views of ``flat`` when it is already fp32, copies otherwise.
        ``master_dtype`` None: views of ``flat`` in its own dtype, for offload_optimizer to copy into fp32 host
        memory (no fp32 copy on the accelerator first)."""
        self.master_shards = MasterShards(self.layout, self.rank, self.param_shards(), master_dtype or self.dtype)

    @property
    def masters(self) -> list[nn.Parameter]:
        """What the optimizer steps: one fp32 piece per parameter fragment this rank owns."""
        return self.master_shards.params if self.master_shards is not None else []

    def fragments(self) -> list[Fragment]:
        """This rank's piece of every parameter, located in the master and gradient shards."""
        shapes = [p.shape for p in self.params]
        return self.master_shards.fragments(self.names, shapes, self.dtype, self.grad_shards())

    # -- gradients -----------------------------------------------------------------------------------------
    def grad_storages(self) -> list[torch.Tensor]:
        """The tensors that own the gradient memory (stage 1's full buffer, stage 2's bucket shards), as they are:
        empty while released, and not restored or zeroed by this call."""
        return [self.flat_grad] if self.full_grads else list(self._grad_own)

    def grad_shard(self, bucket: int) -> torch.Tensor:
        """This rank's reduced gradient for ``bucket`` (scaled like the loss)."""
        return self.grad_shards()[bucket]

    def grad_shards(self) -> list[torch.Tensor]:
        if self._stale:
            self._zero_stale()
        if self._moved:
            self._bring_back(list(self._moved))
        self._restore_full_grads()
        return list(self._grad_shards)

    def grad_view(self, bucket: int) -> torch.Tensor:
        """``bucket``'s gradient shard as it is (it may hold no memory, or no gradient): for its dtype, size and
        device, restoring nothing."""
        return self._grad_shards[bucket]

    def grad_views(self) -> list[torch.Tensor]:
        """As :meth:`grad_shards`, except that a bucket offload moved to the host stays there (its view holds no
        memory): for offload's own step, which reads the host copy."""
        if self._stale:
            self._zero_stale()
        self._restore_full_grads()
        return list(self._grad_shards)

    def releases_grad(self, bucket: Optional[int] = None) -> bool:
        """Whether :meth:`grads_to_host` would give ``bucket``'s memory back now: stage 2, a bucket of its own
        (not lent) holding a reduced gradient, where shards are released."""
        if self.full_grads or bucket is None or bucket in self._lent or not grad_memory.releases(self.device):
            return False
        own = self._grad_own[bucket]
        return not (own.numel() == 0 or grad_memory.is_released(own) or bucket in self._stale)

    def grads_to_host(self, copy_in: Callable[[list[torch.Tensor]], None], norm_types: Sequence[float],
                      in_use: Optional[Any], bucket: Optional[int] = None) -> bool:
        """Stage 2: offload copied ``bucket``'s reduced gradient shard to the host (``in_use``: on that CUDA stream,
        still under way): give its memory back where shards do (grad_memory.releases), keeping its norms of
        ``norm_types`` and its pieces' views (made while the memory is there). ``copy_in`` brings the values back
        for a later reader. Not stage 1 (its buckets view one buffer), nor a lent bucket (a slice of the reducer's
        staging). Whether it was given back."""
        if not self.releases_grad(bucket):
            return False
        own = self._grad_own[bucket]
        self.master_shards.keep_grad_pieces(bucket, own)
        norms = {norm_type: [torch._foreach_norm([own], norm_type, dtype=torch.float32)[0]]
                 for norm_type in norm_types}
        if in_use is not None:
            own.record_stream(in_use)  # its blocks are reused only once that copy is done
        grad_memory.release(own)
        self._moved[bucket] = grad_memory.MovedToHost(copy_in, norms)
        return True

    def _bring_back(self, buckets: list[int]) -> None:
        """The host's values of moved ``buckets`` copied back in (a reader needs them on the accelerator)."""
        for bucket in buckets:
            moved = self._moved.pop(bucket)
            grad_memory.restore(self._grad_own[bucket])
            moved.copy_in([self._grad_own[bucket]])

    def grad_norm_inputs(self, norm_type: float) -> list:
        """What the gradient's norm is computed from, per bucket: the shard, or its norm taken before offload moved
        it to the host (grad_memory.KnownNorm); a norm type offload did not take brings the shards back."""
        if any(norm_type not in moved.norms for moved in self._moved.values()):
            return self.grad_shards()
        views = self.grad_views()
        return [view if bucket not in self._moved else
                grad_memory.KnownNorm(self._moved[bucket].norms[norm_type][0], view.device, view.dtype)
                for bucket, view in enumerate(views)]

    def _restore_full_grads(self) -> None:
        """Stage 1: the full gradient buffer again, zeroed, if its memory was given back after the step (the
        parameters' ``.grad`` were set to None then; autograd's new ones are copied in at the reduction)."""
        if self.full_grads and grad_memory.is_released(self.flat_grad):
            grad_memory.restore(self.flat_grad)
            self.flat_grad.zero_()

    def lend_grad_shard(self, bucket: int, shard: Optional[torch.Tensor]) -> None:
        """Stage 2's last bucket: its gradient shard is ``shard`` (this rank's slice of its staging, reduced in
        place there) from now on; ``None`` gives its own back, with the lent one's reduced gradient if it holds
        one (else stale: the local gradients it held went back to ``param.grad``, last_bucket.py)."""
        own = self._grad_own[bucket]
        if shard is not None:
            if bucket in self._moved:
                self._bring_back([bucket])
            if bucket not in self._stale and not grad_memory.is_released(own):
                shard.copy_(own)  # what it holds (a gradient reduced before a new reducer took over) goes along
                self._lent_reduced.add(bucket)
            self._lent.add(bucket)
            self._grad_shards[bucket] = shard
            self._stale.discard(bucket)
            if grad_memory.releases(self.device) and not grad_memory.is_released(own):
                grad_memory.release(own)  # unused while lent
            return
        self._lent.discard(bucket)
        lent = self._grad_shards[bucket]
        self._grad_shards[bucket] = own
        if bucket in self._lent_reduced:
            self._lent_reduced.discard(bucket)
            self._restore(bucket)
            self._stale.discard(bucket)
            own.copy_(lent)
        else:
            self._stale.add(bucket)

    def holds_reduced(self, bucket: int) -> bool:
        """Whether the lent shard of ``bucket`` holds a reduced gradient (since the last zero_grads)."""
        return bucket in self._lent_reduced

    def take_grad_shard(self, bucket: int) -> tuple[torch.Tensor, bool]:
        """The gradient shard of ``bucket`` for a reduction to write, and whether it is to be overwritten (it
        holds no gradient yet, but was not zeroed) rather than added to."""
        if bucket in self._lent:
            self._lent_reduced.add(bucket)
            return self._grad_shards[bucket], False
        if bucket in self._stale:
            self._restore(bucket)
            self._stale.discard(bucket)
            return self._grad_shards[bucket], True
        if bucket in self._moved:  # a second reduction before the step adds to what the first one left
            self._bring_back([bucket])
        return self._grad_shards[bucket], False

    def _zero_stale(self) -> None:
        for bucket in self._stale:
            self._restore(bucket)
            self._grad_shards[bucket].zero_()
        self._stale.clear()

    def _restore(self, bucket: int) -> None:
        """Stage 2: memory for ``bucket``'s own gradient shard again, if it was given back (after the step it is
        stale, so it is overwritten or zeroed before it is read)."""
        if grad_memory.is_released(self._grad_own[bucket]):
            grad_memory.restore(self._grad_own[bucket])

    def bucket_grad_input(self, bucket: BucketLayout) -> torch.Tensor:
        """Stage 1: the full local gradients of one bucket, gathered into the flat gradient buffer."""
        self._restore_full_grads()
        params, views = self.params, self._grad_views
        for index in bucket.param_indices:
            param, view = params[index], views[index]
            grad = param.grad
            if grad is view:
                continue  # autograd accumulated into the view, as it should
            if grad is None:
                view.zero_()  # released by the user since the last step: no gradient this step
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)  # autograd made a new tensor (the user set .grad to None)
            param.grad = view
        return self.flat_grad[bucket.range.as_slice()]

    def zero_grads(self, cleared: Optional[list] = None) -> None:
        """Zero (or release) the gradients; stage 2 sets the ``.grad`` of ``cleared`` (default: every parameter)
        to None."""
        if self.full_grads and grad_memory.releases(self.device):
            # As zero_grad(set_to_none=True): autograd allocates this step's gradients as it makes them, and the
            # buffer comes back at the first reduction (or read), so the end of forward holds neither.
            if not grad_memory.is_released(self.flat_grad):
                grad_memory.release(self.flat_grad)
            for param in self.params:
                param.grad = None
        elif self.full_grads:
            self.flat_grad.zero_()
            self._point_grads_at_views()
        else:
            # zeroed only if not overwritten first; a lent shard is zeroed with its staging (last_bucket.py)
            self._stale.update(b for b in range(len(self._grad_shards)) if b not in self._lent)
            self._lent_reduced.clear()
            self._moved.clear()
            if grad_memory.releases(self.device):  # nothing to keep: the memory goes back until a reduction
                for own in self._grad_own:
                    if not grad_memory.is_released(own):
                        grad_memory.release(own)
            for param in self.params if cleared is None else cleared:
                param.grad = None

    # -- parameters ----------------------------------------------------------------------------------------
    def shard_of_params(self, bucket: int) -> torch.Tensor:
        """This rank's slice of the parameters in ``bucket`` (a view of ``flat``)."""
        return self.flat[self.layout.buckets[bucket].shard_range(self.rank).as_slice()]

    def param_shards(self) -> list[torch.Tensor]:
        return [self.shard_of_params(b.index) for b in self.layout.buckets]

    def shard_in_memory(self) -> ContextManager:
        return contextlib.nullcontext()  # parameters stay in memory at stages 1-2

    def write_back_masters(self) -> None:
        """Copy updated 16-bit values of this rank's shards from their fp32 masters."""
        self.master_shards.write_back(self.param_shards())
