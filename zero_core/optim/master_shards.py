"""This rank's fp32 master weights of one flat layout, and the optimizer parameters over them.

Storage is one master tensor per bucket (a view of the 16-bit shard when that is fp32 already, else an fp32
copy), so the write-back after a step is one copy per bucket. The optimizer, however, steps one *piece* per
parameter fragment: a leaf ``nn.Parameter`` viewing that fragment's elements of the bucket master. So each
parameter has its own optimizer state (Adam's per-tensor ``step`` included), and a parameter that got no
gradient in a step is given ``grad=None``, which every torch optimizer skips: weights, moments and weight
decay stay as they are, exactly as under DDP (docs/core-api.md, "No gradient, no step").
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Sequence

import torch
from torch import nn

from zero_core.fragments import Fragment
from zero_core.layout import FlatLayout, Range
from zero_core.optim.flat_step import ELEMENTWISE, flat_buckets, stepping_flat
from zero_core.optim.kernels import multi_tensor_kernels, only_params


class MasterShards:
    """fp32 masters of one layout on one rank: bucket storage, and one optimizer parameter per fragment."""

    def __init__(self, layout: FlatLayout, rank: int, param_shards: Sequence[torch.Tensor],
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.buckets = [s.detach() if s.dtype == master_dtype else s.detach().to(master_dtype) for s in param_shards]
        self.pieces = list(layout.fragments(rank))
        self.params = [nn.Parameter(self.buckets[f.bucket][f.shard_range.as_slice()], requires_grad=True)
                       for f in self.pieces]

    # The gradient views of the pieces, made once per gradient storage (not per step): see grad_pieces.
    _grad_key: Optional[list] = None
    _grad_views: list = []
    _bucket_views: Optional[dict] = None  # bucket -> (its shard's key, its pieces' views)
    _bucket_pieces: Optional[dict] = None  # bucket -> its pieces' fragments

    def grad_pieces(self, grad_shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's slice of the part's gradient shards, in ``params`` order. Cached: slicing per piece at
        every step is Python per parameter; the views are made again only if the shards are other tensors. Views
        follow their storage when its memory is given back and allocated again (grad_memory.py), so the key is
        the tensor the shards view, not their address: the offloaded step reads these of a shard moved to the
        host, whose storage holds no memory (and no view of it can be made then: :meth:`keep_grad_pieces` makes
        them before)."""
        key = [_view_key(g) for g in grad_shards]
        old = self._grad_key
        if old is None or len(key) != len(old) or not all(map(_same_view, key, old)):
            views = []
            for bucket, shard in enumerate(grad_shards):
                views += self.keep_grad_pieces(bucket, shard)
            self._grad_views, self._grad_key = views, key
        return self._grad_views

    def keep_grad_pieces(self, bucket: int, shard: torch.Tensor) -> list[torch.Tensor]:
        """The views of ``bucket``'s pieces in its gradient ``shard`` (in ``params`` order), made now unless made
        of that shard before: called while its memory is there, they stay valid once it is given back."""
        if self._bucket_views is None:
            self._bucket_views = {}
            self._bucket_pieces = {}
            for fragment in self.pieces:
                self._bucket_pieces.setdefault(fragment.bucket, []).append(fragment)
        key = _view_key(shard)
        kept = self._bucket_views.get(bucket)
        if kept is None or not _same_view(kept[0], key):
            views = [shard[f.shard_range.as_slice()] for f in self._bucket_pieces.get(bucket, ())]
            kept = self._bucket_views[bucket] = (key, views)
        return kept[1]

    def holds_values(self) -> bool:
        """Whether some master is in memory (NVMe-offloaded ones are swapped out between steps)."""
        return True

    def write_back(self, param_shards: Sequence[torch.Tensor]) -> None:
        """Copy updated values into the 16-bit shards (nothing to do where the master is the shard itself)."""
        for shard, master in zip(param_shards, self.buckets):
            if shard.data_ptr() != master.data_ptr():
                shard.copy_(master)

    def read_from(self, param_shards: Sequence[torch.Tensor],
                  before: Optional[Sequence[torch.Tensor]] = None) -> None:
        """The shards were changed in place (GatheredParameters with a modifier): take their changed values
        (``before``: the shards' values before the change)."""
        for index, (shard, master) in enumerate(zip(param_shards, self.buckets)):
            if shard.data_ptr() != master.data_ptr():
                take_changed_values(master, shard, None if before is None else before[index])

    def fragments(self, names, shapes, dtype: torch.dtype, grad_shards: Sequence[torch.Tensor]) -> list[Fragment]:
        """One Fragment per piece; ``master`` is the piece the optimizer steps (its state has its shape)."""
        fragments = []
        for master, piece in zip(self.params, self.pieces):
            local = piece.shard_range
            fragments.append(Fragment(
                name=names[piece.param_index], shape=shapes[piece.param_index], dtype=dtype,
                param_range=piece.param_range, master=master, grad_shard=grad_shards[piece.bucket][local.as_slice()],
                local=Range(0, local.size)))
        return fragments


def take_changed_values(master: torch.Tensor, value: torch.Tensor, before: Optional[torch.Tensor] = None) -> None:
    """``master`` takes the elements of ``value`` (the model's copy, maybe 16-bit) that differ from ``master``
    rounded to ``value``'s dtype and, where ``before`` (the copy before the change) is given, from ``before``:
    what a ``GatheredParameters`` modifier or ``safe_set_full_fp32_param`` changed. Every other element keeps its
    fp32 value, where copying the whole 16-bit copy would round it (a change to one parameter of a stage 3 unit
    rounded the masters of the whole unit), or set it back by an update the model's copy lags behind (the delayed
    update, offload/delayed_update.py)."""
    with torch.no_grad():
        if value.dtype == master.dtype and before is None:
            master.copy_(value)
            return
        changed = master.to(value.dtype) != value
        if before is not None:
            changed &= value != before
        master.copy_(torch.where(changed, value.to(master.dtype), master))


def _view_key(tensor: torch.Tensor) -> tuple:
    """What identifies a gradient shard's memory across its release and restore: the tensor it views (not the
    address, which changes; held, so that no other tensor takes its ``id``), where in it, and how."""
    return tensor if tensor._base is None else tensor._base, tensor.storage_offset(), tensor.numel(), tensor.dtype


def _same_view(a: tuple, b: tuple) -> bool:
    return a[0] is b[0] and a[1:] == b[1:]


class TileEntry(NamedTuple):
    """One master piece to step, its reduced gradient (a slice of the part's gradient shard), and where it is."""

    piece: nn.Parameter
    grad: torch.Tensor
    part: object  # the FlatParamGroup or ParamUnit owning the piece
    index: int  # the piece's index in part.master_shards


def master_tiles(parts: Sequence, used: Sequence[Sequence[bool]], tile_numel: int) -> list[list[TileEntry]]:
    """The pieces whose parameter got a gradient on some rank (``used``: one mask per part, by parameter index),
    in order, grouped into tiles of at most ``tile_numel`` gradient elements (a bigger piece is a tile alone)."""
    tiles, current, size = [], [], 0
    for part, mask in zip(parts, used):
        masters = part.master_shards
        grads = masters.grad_pieces(part.grad_views())  # (offload reads the host copy of a moved shard)
        for index, (piece, fragment, grad) in enumerate(zip(masters.params, masters.pieces, grads)):
            if not mask[fragment.param_index]:
                continue  # no rank produced a gradient: not stepped (grad stays None)
            numel = fragment.shard_range.size
            if current and size + numel > tile_numel:
                tiles.append(current)
                current, size = [], 0
            current.append(TileEntry(piece, grad, part, index))
            size += numel
    return tiles + ([current] if current else [])


def tile_runs(tile: Sequence[TileEntry]) -> Iterator[tuple]:
    """(part, bucket, start, end, entries): the tile's pieces merged into runs that are contiguous in one bucket
    shard (pieces come in flat order), so that a run is copied with one op instead of one per piece."""
    run = None
    for entry in tile:
        fragment = entry.part.master_shards.pieces[entry.index]
        start, end = fragment.shard_range.start, fragment.shard_range.end
        if run is not None and run[0] is entry.part and run[1] == fragment.bucket and run[3] == start:
            run = (run[0], run[1], run[2], end, run[4] + 1)
            continue
        if run is not None:
            yield run
        run = (entry.part, fragment.bucket, start, end, 1)
    if run is not None:
        yield run


def step_in_tiles(optimizer: torch.optim.Optimizer, parts: Sequence, used: Sequence[Sequence[bool]],
                  inv_scale: float, clip_coef: Optional[torch.Tensor], tile_numel: int) -> None:
    """Step ``optimizer`` over the pieces that got a gradient, each with its gradient unscaled and clipped.

    Gradients already in the masters' dtype (fp32 training) are used in place, in one step. 16-bit gradients
    need an fp32 copy: that copy is made one tile of at most ``tile_numel`` elements at a time (DeepSpeed's
    ``sub_group_size``) into one buffer reused for every tile (on CUDA freed after the step, on the CPU kept:
    see _tile_buffer), the optimizer steps the tile (pieces without ``.grad`` are skipped), so the step never
    holds an fp32 copy of every gradient at once. Either way the optimizer runs its
    multi-tensor kernel where torch has one (kernels.py): one call over all the pieces, not one per piece."""
    with multi_tensor_kernels(optimizer):
        if all(_grads_in_master_dtype(part) for part in parts):
            _step_in_place(optimizer, parts, used, inv_scale, clip_coef)
            return
        for part in parts:  # pieces stepped alone: the flat scalars are compared again before a flat step
            for bucket in getattr(part.master_shards, "flat_buckets", ()):
                bucket.forget()
        for tile in master_tiles(parts, used, tile_numel):
            _step_tile(optimizer, tile, inv_scale, clip_coef, parts[0].master_shards)


def _grads_in_master_dtype(part) -> bool:
    masters = part.master_shards.params
    return not masters or all(g.dtype == masters[0].dtype for g in part.grad_shards())


def unscale_and_clip(grads: list[torch.Tensor], inv_scale: float, clip_coef: Optional[torch.Tensor]) -> None:
    """Unscale, then clip: two multiplications, as the loss scaler and clip_grad_norm_ would do them."""
    if grads and inv_scale != 1.0:
        torch._foreach_mul_(grads, inv_scale)
    if grads and clip_coef is not None:
        torch._foreach_mul_(grads, clip_coef)


def _step_in_place(optimizer: torch.optim.Optimizer, parts: Sequence, used: Sequence[Sequence[bool]],
                   inv_scale: float, clip_coef: Optional[torch.Tensor]) -> None:
    """fp32 gradients: the pieces' gradients are views of the gradient shards, scaled in place (whole shards:
    a few large multiplications; what belongs to unused parameters is zero on every rank). A bucket whose
    pieces all got a gradient is stepped as one tensor where the optimizer allows it (flat_step.py)."""
    stepped, shards, flat = [], [], []
    elementwise = type(optimizer) in ELEMENTWISE
    live = set(map(id, optimizer.state.values())) if elementwise else set()
    for part, mask in zip(parts, used):
        masters = part.master_shards
        grad_shards = part.grad_shards()
        grads = masters.grad_pieces(grad_shards)
        before = len(stepped) + len(flat)
        whole = all(mask)
        for bucket, grad_shard in zip(flat_buckets(masters), grad_shards):
            every = whole or all(map(mask.__getitem__, bucket.param_indices))  # each piece got a gradient
            if elementwise and every and bucket.ready(optimizer, live):
                bucket.param.grad = grad_shard
                flat.append(bucket)
                continue
            for index, param_index, piece in zip(bucket.indices, bucket.param_indices, bucket.pieces):
                if mask[param_index]:
                    piece.grad = grads[index]
                    stepped.append(piece)
            bucket.forget()
        if len(stepped) + len(flat) > before:
            shards += grad_shards
    unscale_and_clip(shards, inv_scale, clip_coef)
    with stepping_flat(optimizer, flat):
        optimizer.step()
    for bucket in flat:
        bucket.after_step()
    for piece in stepped:
        piece.grad = None


def _tile_buffer(piece: torch.Tensor, numel: int, holder: "MasterShards") -> torch.Tensor:
    """An fp32 buffer for one tile's gradients. On CUDA a fresh one per tile (the caching allocator reuses the
    memory). On the CPU a large fresh buffer is freshly mapped memory whose page faults cost more than the copy,
    so ``holder`` (the step's first part) keeps one between steps: at most one tile, the ``sub_group_size``
    bound."""
    if piece.device.type != "cpu":
        return torch.empty(numel, dtype=piece.dtype, device=piece.device)
    scratch = getattr(holder, "tile_scratch", None)
    if scratch is None or scratch.numel() < numel:
        scratch = holder.tile_scratch = torch.empty(numel, dtype=piece.dtype)
    return scratch[:numel]


def _step_tile(optimizer: torch.optim.Optimizer, tile: list[TileEntry], inv_scale: float,
               clip_coef: Optional[torch.Tensor], holder: MasterShards) -> None:
    """16-bit gradients: one fp32 buffer for the tile, filled with one cast copy per run of contiguous pieces
    (torch's multi-tensor copy takes a slow path when it casts), scaled in one go."""
    sizes = [entry.grad.numel() for entry in tile]
    buffer = _tile_buffer(tile[0].piece, sum(sizes), holder)
    views = buffer.split(sizes)
    offset = 0
    for part, bucket, start, end, _ in tile_runs(tile):
        buffer[offset : offset + end - start].copy_(part.grad_shards()[bucket][start:end])
        offset += end - start
    unscale_and_clip([buffer], inv_scale, clip_coef)
    for entry, grad in zip(tile, views):
        entry.piece.grad = grad
    with only_params(optimizer, [entry.piece for entry in tile]):
        optimizer.step()
    for entry in tile:
        entry.piece.grad = None
