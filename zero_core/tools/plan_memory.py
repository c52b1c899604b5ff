"""Bytes one rank holds for a model, counted from the same plans the engine allocates from (zero_core/planning.py),
class by class as ``engine.memory_stats()`` counts the allocated tensors after a step.

Everything here is exact for the engine as written, with one assumption: the stage 2 scratch pool is replayed
with gradients arriving in reverse model order (what autograd does for a model that uses its parameters in
registration order); another arrival order can hold a different number of staging buffers at once.
The layouts' alignment depends on the device the engine allocates on: ``for_device`` fixes it in the config once,
so every plan counted here is the plan the engine makes on that device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from zero_core.comm.quantize import wire_bytes
from zero_core.config import ZeroConfig
from zero_core.layout import FlatLayout
from zero_core.planning import (
    PARTITIONED_IN_FLIGHT,
    REPLICATED_IN_FLIGHT,
    ParamSpec,
    layout_alignment,
    plan_replicated,
    plan_units,
    pool_capacity,
    reduction_order,
    step_tile_numel,
)

FP32 = "torch.float32"
MASTER_BYTES = 4  # fp32 master elements


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds after a step, by class of ``memory_stats()``, plus the transients."""

    params: int
    grads: int
    fp32_master: int
    optimizer_state: int
    buffers: int
    live_params: int  # stage 3: gathered besides the persistent units while a module runs (transient)
    step_tile: int  # the fp32 copy of one tile of 16-bit gradients while the optimizer steps (transient)
    shard_numel: int  # trainable elements whose master this rank holds (padding included)


@dataclass(frozen=True)
class _Part:
    """One flat group or unit as the estimator sees it: its layout and element sizes."""

    layout: FlatLayout
    dtype: str  # the dtype it is allocated in
    element_size: int
    trainable: bool
    persistent: bool = False
    tile: bool = False  # a TiledLinear tile's unit (stage3/tile_units.py)


def for_device(cfg: ZeroConfig, device) -> ZeroConfig:
    """``cfg`` with ``shard_alignment`` resolved for parameters on ``device`` (planning.layout_alignment)."""
    alignment = layout_alignment(cfg, device)
    return cfg if cfg.shard_alignment == alignment else dataclasses.replace(cfg, shard_alignment=alignment)


def rank_bytes(info, cfg: ZeroConfig, n: int, stage: int, precision: str, k_bytes: int, tensor_bytes: int,
               rank: Optional[int]) -> RankBytes:
    """``info`` (a ModelInfo) under ``stage`` (1-3) on shard groups of ``n`` ranks, seen from ``rank``; with
    ``rank=None`` the most any rank holds, class by class (only optimizer state and the step tile differ by
    rank: the last rank of each bucket owns its padding, which has no optimizer state)."""
    cast = precision != "fp32"
    if stage == 3:
        parts, plan = _units(info, cfg, n, precision)
    else:
        plan, sizes, positions = _replicated_plan(info, cfg, n, precision)
        parts = [_Part(g.layout, g.dtype, sizes[g.dtype], True) for g in plan.groups]
    trainable = [p for p in parts if p.trainable]
    if stage == 3:
        params = sum(_stage3_param_bytes(p, cfg) for p in parts)
    else:
        params = sum(p.layout.total * p.element_size for p in parts)
    if stage < 3:  # parameters outside the flat groups stay whole on every rank
        params += sum(_final_size(p, cast) * p.numel for p in info.params if p.group is None or not p.trainable)
    grads = sum((p.layout.total if stage == 1 else p.layout.shard_numel) * p.element_size for p in trainable)
    master = sum(MASTER_BYTES * p.layout.shard_numel for p in trainable if p.dtype != FP32)
    # Every trainable part fp32 (its own master), no offload: Adam, AdamW and SGD step whole bucket shards
    # (optim/flat_step.py), so their per-element state covers each stepped shard's padding too (the estimate
    # assumes such an optimizer and one optimizer over all parts, as the engine's step decides per optimizer)
    offloaded = cfg.offload_optimizer is not None and cfg.offload_optimizer.device != "none"
    flat = not offloaded and all(p.dtype == FP32 for p in trainable)
    state = tile = 0
    for r in range(n) if rank is None else [rank]:
        pieces = [_pieces(p.layout, r) for p in trainable]
        elements = [_flat_state_numel(p.layout, r) for p in trainable] if flat else [sum(s) for s in pieces]
        state = max(state, sum(k_bytes * e + tensor_bytes * len(sizes) for e, sizes in zip(elements, pieces)))
        tile = max(tile, _step_tile_bytes(trainable, pieces, cfg))
    # overlap_comm as the engine resolves it (ZeroConfig.resolved_overlap_comm), for the stage estimated
    overlap = stage == 3 if cfg.overlap_comm is None else cfg.overlap_comm
    if stage == 3:
        pool = _stage3_pool(trainable, plan, overlap)
    else:
        pool = _replicated_pool(plan, sizes, positions, cfg, stage, overlap)
    return RankBytes(
        params=params, grads=grads, fp32_master=master, optimizer_state=state,
        buffers=_buffer_bytes(info, cast) + pool,
        live_params=_live_bytes(info, parts, cfg) if stage == 3 else 0,
        step_tile=tile,
        shard_numel=sum(p.layout.shard_numel for p in trainable),
    )


def _stage3_param_bytes(part: _Part, cfg: ZeroConfig) -> int:
    """A unit's bytes on this rank: its shard (a frozen gathered unit's as 8-bit codes with a scale and minimum
    per block under ``zero_quantized_nontrainable_weights``, unless parameters are offloaded), plus the whole
    unit when it is persistent."""
    if part.persistent:
        return (part.layout.shard_numel + part.layout.total) * part.element_size
    offload = cfg.offload_param
    if not part.trainable and cfg.zero_quantized_nontrainable_weights and (offload is None or offload.device == "none"):
        return sum(wire_bytes(1, b.shard_size, 8, asymmetric=True) for b in part.layout.buckets)
    return part.layout.shard_numel * part.element_size


# -- the plans, from a ModelInfo --------------------------------------------------------------------------

def _final_size(param, cast: bool) -> int:
    """Bytes per element after the config's cast (floating parameters go 16-bit under fp16/bf16)."""
    return 2 if cast and param.floating else param.element_size


def _replicated_plan(info, cfg: ZeroConfig, n: int, precision: str):
    """Stages 1-2: the engine casts the model first, then plans one flat buffer per (group, dtype). Returns the
    plan, the element size of each dtype, and each group's parameters' model positions (the reduction order)."""
    cast = precision != "fp32"
    by_group: list[list[ParamSpec]] = [[] for _ in range(info.group_count)]
    positions: list[list[int]] = [[] for _ in range(info.group_count)]
    sizes = {}
    for position, p in enumerate(info.params):
        if p.trainable and p.group is not None:
            dtype = _cast_dtype(p, precision) if cast else p.dtype
            by_group[p.group].append(ParamSpec(p.numel, dtype, p.group))
            positions[p.group].append(position)
            sizes[dtype] = _final_size(p, cast)
    return plan_replicated(by_group, n, cfg), sizes, positions


def _cast_dtype(param, precision: str) -> str:
    return {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision] if param.floating else param.dtype


def _units(info, cfg: ZeroConfig, n: int, precision: str) -> tuple[list[_Part], object]:
    """Stage 3: units keyed by each parameter's own dtype, allocated in the training dtype."""
    plan, order = _units_plan(info, cfg, n)
    parts = []
    for unit in plan.units:
        first = info.params[order[unit.members[0]]]
        if first.floating:
            dtype, size = (FP32, 4) if precision == "fp32" else (_cast_dtype(first, precision), 2)
        else:
            dtype, size = first.dtype, first.element_size
        parts.append(_Part(unit.layout, dtype, size, unit.trainable, unit.persistent, first.tile))
    return parts, plan


def _units_plan(info, cfg: ZeroConfig, n: int):
    """The plan, and the ModelInfo index of each planned parameter (modules in order of first appearance)."""
    by_module: dict[str, list[int]] = {}
    for index, p in enumerate(info.params):
        by_module.setdefault(p.module, []).append(index)
    specs = [(module, [_unit_spec(info.params[i]) for i in indices]) for module, indices in by_module.items()]
    return plan_units(specs, n, cfg), [i for indices in by_module.values() for i in indices]


def _unit_spec(p) -> ParamSpec:
    return ParamSpec(p.numel, p.dtype, p.group if p.trainable else None, p.module)


# -- per rank ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _flat_state_numel(layout: FlatLayout, rank: int) -> int:
    """Elements of per-element optimizer state ``rank`` holds when each bucket shard with a piece is stepped
    whole: the shard, padding included."""
    buckets = {f.bucket for f in layout.fragments(rank)}
    return sum(layout.buckets[b].shard_size for b in buckets)


@functools.lru_cache(maxsize=4096)
def _pieces(layout: FlatLayout, rank: int) -> tuple[int, ...]:
    """Sizes of the master pieces ``rank`` steps (one per parameter fragment it owns: padding has none)."""
    return tuple(f.param_range.size for f in layout.fragments(rank))


def _step_tile_bytes(trainable: Sequence[_Part], pieces: Sequence[tuple[int, ...]], cfg: ZeroConfig) -> int:
    """The largest fp32 copy ``master_shards.step_in_tiles`` makes: pieces packed in order into tiles of at most
    ``step_tile_numel`` elements (a bigger piece alone); only 16-bit gradients are copied, fp32 ones stepped in
    place (all fp32: no copy at all)."""
    if all(p.dtype == FP32 for p in trainable):
        return 0
    limit = step_tile_numel(cfg)
    largest = size = copied = 0
    for part, sizes in zip(trainable, pieces):
        for numel in sizes:
            if size and size + numel > limit:
                size = copied = 0
            size += numel
            copied += numel if part.dtype != FP32 else 0
            largest = max(largest, copied)
    return MASTER_BYTES * largest


def _buffer_bytes(info, cast: bool) -> int:
    """Module buffers; floating ones are cast with the parameters under fp16/bf16."""
    floating = sum(numel * size for numel, size in info.floating_buffers)
    if not cast:
        return info.buffer_bytes
    return info.buffer_bytes - floating + 2 * sum(numel for numel, _ in info.floating_buffers)


def _live_bytes(info, parts: Sequence[_Part], cfg: ZeroConfig) -> int:
    """Stage 3 gathers at most ``max_live_parameters`` elements besides the persistent units, at least the
    largest unit; of the tiles of ``TiledLinear`` layers at most two at once (the running one and the next,
    prefetched), whatever the budget."""
    gathered = [p for p in parts if not p.persistent]
    largest = max((p.layout.total for p in gathered), default=0)
    size = max((p.element_size for p in gathered), default=0)
    live = min(info.trainable_numel, max(cfg.max_live_parameters, largest))
    tiles = [p.layout.total for p in gathered if p.tile]
    if tiles:
        live = min(live, sum(p.layout.total for p in gathered if not p.tile) + 2 * max(tiles))
    return live * size


def hpz_secondary_bytes(info, cfg: ZeroConfig, n: int, precision: str) -> int:
    """hpZ: each gathered (non-persistent) unit's 1/R in-node slice, held from the forward to the step."""
    parts, _ = _units(info, cfg, n, precision)
    gathered = [p for p in parts if not p.persistent]
    size = max((p.element_size for p in gathered), default=0)
    return sum(p.layout.total for p in gathered) // cfg.zero_hpz_partition_size * size


# -- scratch pools -----------------------------------------------------------------------------------------

def _stage3_pool(trainable: Sequence[_Part], plan, overlap: bool) -> int:
    """Every stage 3 reduction takes a whole bucket buffer of the plan's ``reduce_bucket_numel``; one fills while
    ``PARTITIONED_IN_FLIGHT`` are in flight with ``overlap_comm`` (none without)."""
    if not trainable:
        return 0
    held = min(len(trainable), 1 + (PARTITIONED_IN_FLIGHT if overlap else 0))
    return held * plan.reduce_bucket_numel * trainable[0].element_size


class _PoolReplay:
    """The allocations of a BufferPool (buffer_pool.py) serving a sequence of acquires and releases."""

    def __init__(self, largest: int) -> None:
        self.largest = largest
        self.free: Counter = Counter()
        self.allocated = 0

    def acquire(self, numel: int, dtype: str, element_size: int) -> tuple:
        key = (dtype, pool_capacity(numel, self.largest), element_size)
        if self.free[key]:
            self.free[key] -= 1
        else:
            self.allocated += key[1] * element_size
        return key

    def release(self, keys: Sequence[tuple]) -> None:
        for key in keys:
            self.free[key] += 1


def _replicated_pool(plan, sizes: dict, positions: list, cfg: ZeroConfig, stage: int, overlap: bool) -> int:
    """Stages 1-2: replay the gradient reducer (replicated/grad_reducer.py) through the pool. Each reduction of
    stages 1-2 takes no scratch of its own (each bucket is reduced in place); stage 2 stages each bucket whole
    from its first gradient to its launch. Buckets launch from the end of the reduction order, each once it and every later one are
    complete, keeping ``REPLICATED_IN_FLIGHT`` in flight with ``overlap_comm``."""
    entries = [(g, b.index, [positions[g.group_index][g.members[i]] for i in b.param_indices])
               for g in plan.groups for b in g.layout.buckets]
    order = reduction_order(entries)
    pool = _PoolReplay(plan.pool_largest)
    keep = REPLICATED_IN_FLIGHT if overlap else 0
    inflight: list[list[tuple]] = []

    # each bucket is reduced in place (stage 1: its full gradient buffer, whose slice is this rank's gradient
    # shard; stage 2: its staging buffer), with no scratch; qgZ (stage 3 only) would need its own output
    in_place = not cfg.zero_quantized_gradients

    def launch(group, bucket: int, staging: Optional[tuple]) -> None:
        layout = group.layout.buckets[bucket]
        held = [staging] if staging is not None else []
        if cfg.reduce_scatter and not in_place:
            held.append(pool.acquire(layout.shard_size, group.dtype, sizes[group.dtype]))
        inflight.append(held)
        while len(inflight) > keep:
            pool.release(inflight.pop(0))

    if stage == 1:  # one pass at the step, from the full gradient buffers
        for group, bucket in reversed(order):
            launch(group, bucket, None)
    else:
        _replay_backward(order, positions, pool, sizes, launch)
    pool.release([key for held in inflight for key in held])
    return pool.allocated


def _replay_backward(order, positions, pool: _PoolReplay, sizes: dict, launch) -> None:
    """Stage 2's hooks with gradients arriving in reverse model order, then the end-of-backward flush."""
    where, expected = {}, []
    for index, (group, bucket) in enumerate(order):
        members = group.layout.buckets[bucket].param_indices
        expected.append(len(members))
        for i in members:
            where[positions[group.group_index][group.members[i]]] = index
    staging: dict[int, tuple] = {}
    if order:  # the bucket reduced last keeps its staging from setup on, never back to the pool (last_bucket.py)
        group, bucket = order[0]
        pool.acquire(group.layout.buckets[bucket].range.size, group.dtype, sizes[group.dtype])
    seen = Counter()
    cursor = len(order) - 1
    for model_position in sorted(where, reverse=True):
        index = where[model_position]
        group, bucket = order[index]
        if index not in staging and index:
            staging[index] = pool.acquire(group.layout.buckets[bucket].range.size, group.dtype, sizes[group.dtype])
        seen[index] += 1
        while cursor > 0 and seen[cursor] >= expected[cursor]:
            launch(*order[cursor], staging.pop(cursor))
            cursor -= 1
    while cursor > 0:  # nothing is left once every gradient arrived; kept for buckets without gradients
        group, bucket = order[cursor]
        held = staging.pop(cursor, None) or pool.acquire(group.layout.buckets[bucket].range.size, group.dtype,
                                                          sizes[group.dtype])
        launch(group, bucket, held)
        cursor -= 1
    if order:
        launch(*order[0], None)  # reduced at the step, in place in the staging it keeps


def engine_plan(info, cfg: ZeroConfig, n: int, stage: int, precision: str, device=None):
    """The plan the engine makes for this model on ``device`` (None: the CPU): a ReplicatedPlan for stages 1-2,
    a PartitionedPlan for 3."""
    cfg = for_device(cfg, device)
    if stage == 3:
        return _units(info, cfg, n, precision)[1]
    return _replicated_plan(info, cfg, n, precision)[0]
