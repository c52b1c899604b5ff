"""Stage 3's unit of partitioning: one module's own parameters of one optimizer group and dtype.

Each rank keeps only its shard (``shard``: its slice of every bucket of the unit's flat layout, concatenated).
``full`` is the gathered flat buffer; the parameters are views of it, and its storage is resized to zero while
the unit is sharded, so the views (and autograd's references to them) stay valid objects that hold no memory.
Gathering resizes it back and all-gathers each bucket straight into place: no copy-out.
"""

from __future__ import annotations

import contextlib

import enum
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from zero_core import grad_memory
from zero_core.stage3 import streams as side_streams
from zero_core.stage3.coalesced import CoalescedGather
from zero_core.comm.communicator import Communicator
from zero_core.fragments import Fragment
from zero_core.layout import FlatLayout
from zero_core.optim.master_shards import MasterShards
from zero_core.stage3.partitioned_param import set_gather_on_read_flag, unguarded
from zero_core.comm.quantize import BLOCK, Quantized, quantize
from zero_core.contracts import wait_for_update


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # an all-gather is in flight (prefetch)
    GATHERED = "gathered"


class ParamUnit:
    """Partitioned storage, gather/release, gradient shard and fp32 masters of one unit; a
    ``zero_core.contracts.Part``."""

    update_in_flight = None  # an overlapped offloaded step's handle until this unit's shard holds its update
    reduced_whole = False  # its last reduction had a gradient for every parameter on this rank (gradients.py)

    def __init__(
        self,
        index: int,
        module_name: str,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        group_index: Optional[int],
        layout: FlatLayout,
        comm: Communicator,
        dtype: torch.dtype,
    ) -> None:
        self.index = index
        self.module_name = module_name
        self.params = list(params)
        self.names = list(names)
        self.group_index = group_index  # None: frozen (or in no optimizer group): no gradient, no master
        self.layout = layout
        self.numel = layout.total  # elements of the gathered flat buffer, padding included
        self.comm = comm
        self.rank = comm.topology.rank
        self.dtype = dtype  # the training dtype; shard_values() casts the values
        self.device = self.params[0].device
        self.persistent = False
        self.state = UnitState.GATHERED
        self._works: list = []
        self._source: Optional[torch.Tensor] = None
        # offload_param (zero_core/offload): the shard was moved off the accelerator; with nvme it lives in a file
        # (param_swap.py), ``shard`` is empty between uses and ``swapped_shard`` is its (numel, dtype)
        self.offloaded = False
        self.swap = None
        self.swapped_shard: Optional[tuple[int, torch.dtype]] = None
        # zero_quantized_nontrainable_weights (set by the runtime before shard_values): a frozen, non-persistent unit
        # keeps its shard as 8-bit codes with per-block scales and minima (one Quantized per bucket), and
        # ``shard`` is empty; its gathers send the codes and dequantise (docs/multinode.md)
        self.store_quantized = False
        self.quantized: Optional[list[Quantized]] = None
        self._offsets = layout.shard_offsets()
        self._grad_shard = None
        self._grad_buckets: list[torch.Tensor] = []  # its bucket views, made while it has memory (grad_views)
        self._moved: Optional[grad_memory.MovedToHost] = None  # offload moved the reduced shard to the host
        if self.trainable:  # born released where shards give their memory back (the first reduction allocates it);
            # made before ``full`` and ``shard``, which then reuse its memory: setup's peak does not hold all three
            self._grad_shard = torch.empty(layout.shard_numel, dtype=self.dtype, device=self.device)
            self._grad_buckets = [self._bucket_shard(self._grad_shard, b.index) for b in layout.buckets]
            if grad_memory.releases(self.device):
                grad_memory.release(self._grad_shard)
            else:
                self._grad_shard.zero_()
        self.full = torch.zeros(layout.total, dtype=self.dtype, device=self.device)
        self.shard = torch.zeros(layout.shard_numel, dtype=self.dtype, device=self.device)
        # Each bucket of ``full`` seen as (rank, slice): where a coalesced all-gather's rank-major result goes.
        # Views of ``full`` stay valid while its storage is resized to zero and back.
        self.rank_views = [self.full[b.range.as_slice()].view(layout.world_size, b.shard_size)
                           for b in layout.buckets]
        self.master_shards: Optional[MasterShards] = None
        self.on_grad_reduced = None  # offload (zero_core/offload): called with (self, None) after each reduction
        self.streams = side_streams.NONE  # the runtime's CUDA side streams (streams.py), none on the CPU

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """This rank's reduced gradient of the unit (None if frozen); zeros after a step, even where its memory was
        given back (grad_memory.py)."""
        if self._grad_shard is not None and grad_memory.is_released(self._grad_shard):
            grad_memory.restore(self._grad_shard)
            moved, self._moved = self._moved, None
            if moved is None:
                self._grad_shard.zero_()
            else:  # offload copied it to the host and gave the memory back: its values come back in
                moved.copy_in(list(self._grad_buckets))
        return self._grad_shard

    def grad_storage(self) -> Optional[torch.Tensor]:
        """The tensor that owns the gradient shard's memory, as it is (empty while released; not restored)."""
        return self._grad_shard

    def grads_released(self) -> bool:
        """Whether the gradient shard's memory was given back since the last step (the next access zeroes it, or
        copies it back in from the host where offload moved it there)."""
        return self._grad_shard is not None and grad_memory.is_released(self._grad_shard)

    def grad_views(self) -> list[torch.Tensor]:
        """The gradient shards as :meth:`grad_shards`, except that one offload moved to the host stays there (its
        views hold no memory): for offload's own step, which reads the host copy, and needs these only for their
        dtype and device, and to copy from where the host copy is not current."""
        if self._moved is None:
            return self.grad_shards()
        return list(self._grad_buckets)

    def grad_norm_inputs(self, norm_type: float) -> list:
        """What the gradient's norm is computed from, per bucket: the shard, or its norm taken before offload moved
        it to the host (grad_memory.KnownNorm), for the norm types offload took; any other brings the shard back."""
        known = self._moved.norms.get(norm_type) if self._moved is not None else None
        if known is None:
            return self.grad_shards()
        return [view if norm is None else grad_memory.KnownNorm(norm, view.device, view.dtype)
                for view, norm in zip(self._grad_buckets, known)]

    def grad_view(self, bucket: int) -> torch.Tensor:
        """``bucket``'s gradient shard as it is (it may hold no memory): for its dtype, size and device."""
        return self._grad_buckets[bucket]

    def releases_grad(self, bucket: Optional[int] = None) -> bool:
        """Whether :meth:`grads_to_host` would give the shard's memory back now (``bucket`` None: the whole unit's,
        holding a reduced gradient, where shards are released)."""
        return not (self._grad_shard is None or bucket is not None or self.grads_released()
                    or not grad_memory.releases(self.device))

    def grads_to_host(self, copy_in: Callable[[list[torch.Tensor]], None], norm_types: Sequence[float],
                      in_use: Optional[torch.cuda.Stream], bucket: Optional[int] = None) -> bool:
        """Offload copied the reduced gradient shard (every bucket: ``bucket`` is None at stage 3) to the host
        (``in_use``: on that CUDA stream, still under way):
        give its memory back where shards do (grad_memory.releases), keeping the norms of ``norm_types``, and the
        piece views the offloaded step reads (made while the memory is there). ``copy_in`` brings the values back
        for a later reader. Whether it was given back."""
        if not self.releases_grad(bucket):
            return False
        shards = self.grad_shards()
        self.master_shards.grad_pieces(shards)  # cached views of the storage: valid while it is empty
        norms = {}
        for norm_type in norm_types:
            filled = [s for s in shards if s.numel()]
            values = iter(torch._foreach_norm(filled, norm_type, dtype=torch.float32) if filled else ())
            norms[norm_type] = [next(values) if s.numel() else None for s in shards]
        if in_use is not None:
            self._grad_shard.record_stream(in_use)  # its blocks are reused only once that copy is done
        grad_memory.release(self._grad_shard)
        self._moved = grad_memory.MovedToHost(copy_in, norms)
        return True

    @property
    def trainable(self) -> bool:
        return self.group_index is not None

    def active_count(self) -> int:
        """Parameters that take part in backward now (not frozen with requires_grad=False)."""
        with unguarded():
            return sum(1 for p in self.params if p.requires_grad)

    def _bucket_shard(self, tensor: torch.Tensor, bucket: int) -> torch.Tensor:
        start = self._offsets[bucket]
        return tensor[start : start + self.layout.buckets[bucket].shard_size]

    # -- building ------------------------------------------------------------------------------------------
    def shard_values(self, values: Sequence[torch.Tensor], broadcast: bool,
                     master_dtype: Optional[torch.dtype] = torch.float32) -> None:
        """Take whole values for every parameter, keep this rank's shard, point the parameters at views of
        ``full`` and release it. ``broadcast``: start from rank 0's values (as DDP does). ``master_dtype`` None:
        the masters are views of the shard, for offload_optimizer to copy into fp32 host memory (no fp32 copy of
        every shard on the accelerator first: at setup that was 4 bytes per parameter of its peak)."""
        for value, slot in zip(values, self.layout.slots):
            self.full[slot.range.as_slice()].copy_(value.detach().reshape(-1))
        if broadcast:
            self.comm.broadcast(self.full, src=0)
        self._take_shard_from_full()
        if self.store_quantized:
            self._quantize_shard()
        for param, slot in zip(self.params, self.layout.slots):
            param.data = self.full[slot.range.as_slice()].view(param.shape)
        if self.trainable:
            self.master_shards = MasterShards(self.layout, self.rank, self.param_shards(), master_dtype or self.dtype)
        self.release()  # persistent units stay gathered

    @property
    def masters(self) -> list[nn.Parameter]:
        """What the optimizer steps: one fp32 piece per parameter fragment this rank owns."""
        return self.master_shards.params if self.master_shards is not None else []

    def param_shards(self) -> list[torch.Tensor]:
        return [self._bucket_shard(self.shard, b.index) for b in self.layout.buckets]

    def _take_shard_from_full(self) -> None:
        for bucket in self.layout.buckets:
            self._bucket_shard(self.shard, bucket.index).copy_(self.full[bucket.shard_range(self.rank).as_slice()])

    def _quantize_shard(self) -> None:
        """Keep the shard as 8-bit codes (asymmetric, per block) and free its 16-bit storage."""
        self.quantized = [quantize(self._bucket_shard(self.shard, b.index).reshape(1, -1), 8, BLOCK, None, True)
                          for b in self.layout.buckets]
        self.shard = torch.empty(0, dtype=self.dtype, device=self.device)

    def stored(self) -> list[torch.Tensor]:
        """The tensors holding this rank's shard (memory_stats counts them)."""
        if self.quantized is None:
            return [self.shard]
        return [t for packed in self.quantized for t in packed]

    # -- gather / release ----------------------------------------------------------------------------------
    def gather(self, async_op: bool = False, phase: Optional[str] = None) -> None:
        """``phase`` ("forward"/"backward", from the hooks) lets the comm layer pick ZeRO++'s paths."""
        if self.state is UnitState.SHARDED:
            gather_together([self], self.comm, phase)
        if not async_op:
            self.wait()

    def _allocate(self) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        set_gather_on_read_flag(self.params, False)  # [Note: compiled reads] (partitioned_param.py)

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            for work in self._works:
                work.wait()
            self._works = []
            self.drop_gather_source()
            self.state = UnitState.GATHERED

    def gather_source(self) -> torch.Tensor:
        """This rank's shard on the gathering device, to send: the shard itself, or with offload_param
        (zero_core/offload) a copy of the host shard, or the shard read from NVMe into a pool buffer (a blocking
        copy: the buffer is reused once the gather is done). Held until ``drop_gather_source``."""
        if self.swap is not None:
            self._source = self.swap.read(self).to(self.full.device)
        else:
            self._source = self.shard.to(self.full.device, non_blocking=True)
        return self._source

    def drop_gather_source(self) -> None:
        self._source = None
        if self.swap is not None:
            self.swap.release(self)

    def shard_in_memory(self):
        """A context in which ``shard`` holds this rank's values (offload_param nvme reads and rewrites it)."""
        return self.swap.resident(self) if self.swap is not None else contextlib.nullcontext()

    def _gather_alone(self, phase: Optional[str]) -> None:
        """One all-gather per bucket through the comm layer's ZeRO++ paths (quantised, hierarchical, hpZ's
        secondary partition), which keep per-buffer state (``key``) and so are not coalesced with other units."""
        if self.quantized is not None:
            self._works = [
                self.comm.all_gather_packed(self.full[b.range.as_slice()], self.quantized[b.index], b.shard_size,
                                            async_op=True, label=self.module_name, phase=phase, key=(self.index, b.index))
                for b in self.layout.buckets
            ]
            self.state = UnitState.GATHERING
            return
        source = self.gather_source()
        self._works = [
            self.comm.all_gather(self.full[b.range.as_slice()], self._bucket_shard(source, b.index), async_op=True,
                                 label=self.module_name, phase=phase, key=(self.index, b.index),
                                 frozen=not self.trainable)
            for b in self.layout.buckets
        ]
        self.state = UnitState.GATHERING

    def drop_pending(self) -> None:
        """Forget an in-flight gather without waiting (teardown after the process group is gone)."""
        if self.state is UnitState.GATHERING:
            for work in self._works:
                if isinstance(work, CoalescedGather):
                    work.drop()
            self._works = []
            self.drop_gather_source()
            self.state = UnitState.GATHERED

    def release(self, force: bool = False) -> None:
        """Free the gathered storage (persistent units keep it unless ``force``)."""
        if self.state is UnitState.SHARDED or (self.persistent and not force):
            return
        self.wait()
        self.full.untyped_storage().resize_(0)
        set_gather_on_read_flag(self.params, True)
        self.state = UnitState.SHARDED

    def write_full_into_shard(self) -> None:
        """After the full values were changed in place (GatheredParameters with a modifier): keep them."""
        if self.quantized is not None:
            self.shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            self._take_shard_from_full()
            self._quantize_shard()
            return
        with self.shard_in_memory():
            # the shard as it was: what the edit changed is what differs from it (the model may lag the masters)
            before = None if self.master_shards is None else [s.clone() for s in self.param_shards()]
            self._take_shard_from_full()
            if self.master_shards is not None:
                self.master_shards.read_from(self.param_shards(), before)

    # -- gradients -----------------------------------------------------------------------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        if not self.trainable:
            return []
        return [self._bucket_shard(self.grad_shard, b.index) for b in self.layout.buckets]

    def stage_grads(self, by_rank: torch.Tensor, column: int) -> list[str]:
        """Copy each parameter's ``.grad`` into ``by_rank`` and free it. ``by_rank`` is a coalesced reduction's
        rank-major buffer (row ``r``: what rank ``r`` receives); this unit's shard-shaped part starts at
        ``column``, so bucket ``b`` occupies ``by_rank[:, column + offset_b :][:, :shard_size_b]`` with its flat
        elements in row-major order. Padding and parameters without a gradient get zeros. Returns the names of
        trainable parameters with none (a frozen one contributes zeros). One concatenation per bucket, straight
        into place when the target is contiguous (this runs for every unit of every backward)."""
        missing = []
        with unguarded():
            for bucket, offset in zip(self.layout.buckets, self._offsets):
                pieces, used = [], bucket.range.start
                for index in bucket.param_indices:
                    param, slot = self.params[index], self.layout.slots[index]
                    if slot.range.start > used:
                        pieces.append(by_rank.new_zeros(slot.range.start - used))
                    grad = param.grad
                    if grad is None:
                        pieces.append(by_rank.new_zeros(slot.range.size))
                        if param.requires_grad:
                            missing.append(self.names[index])
                    else:
                        pieces.append(grad.reshape(-1))
                        param.grad = None
                    used = slot.range.end
                if used < bucket.range.end:  # padding
                    pieces.append(by_rank.new_zeros(bucket.range.end - used))
                target = by_rank[:, column + offset : column + offset + bucket.shard_size]
                if target.is_contiguous():
                    torch.cat(pieces, out=target.view(-1))
                else:
                    target.copy_(torch.cat(pieces).view(target.shape))
        return missing

    def zero_grads(self) -> None:
        self._moved = None  # (a host copy offload kept is stale now)
        if self._grad_shard is not None and not self.grads_released():
            if grad_memory.releases(self._grad_shard.device):
                grad_memory.release(self._grad_shard)  # zeros again at its next access
            else:
                self._grad_shard.zero_()
        with unguarded():
            for param in self.params:
                param.grad = None

    # -- optimizer side ------------------------------------------------------------------------------------
    def write_back_masters(self) -> None:
        if self.swap is not None and not self.master_shards.holds_values():
            return  # NVMe-swapped masters: the offloaded step wrote them back tile by tile
        with self.shard_in_memory():
            self.master_shards.write_back(self.param_shards())

    def fragments(self) -> list[Fragment]:
        if not self.trainable:
            return []
        shapes = [p.shape for p in self.params]
        return self.master_shards.fragments(self.names, shapes, self.dtype, self.grad_shards())


def gather_together(units: Sequence[ParamUnit], comm: Communicator, phase: Optional[str] = None) -> None:
    """Start one all-gather for these sharded units (coalesced.py); each completes on its ``wait()``. Units whose
    gather takes a ZeRO++ path in this ``phase`` gather alone, and so do large units where the transport gains
    nothing from coalescing them (``Communicator.gathers_alone``: gloo), after the coalesced rest."""
    plain = []
    for unit in units:
        wait_for_update(unit)  # an overlapped step writes this unit's shard: its update first
        unit._allocate()
        if unit.quantized is None and comm.plain_gather(phase, frozen=not unit.trainable):
            plain.append(unit)
        else:
            unit._gather_alone(phase)
    alone = [[unit] for unit in plain if comm.gathers_alone(unit.numel)]  # large units on gloo: straight into place
    together = [unit for unit in plain if not comm.gathers_alone(unit.numel)]
    for batch in ([together] if together else []) + alone:
        gathering = CoalescedGather(batch, comm, batch[0].streams.gather)
        for unit in batch:
            unit._works = [gathering]
            unit.state = UnitState.GATHERING

