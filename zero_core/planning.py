"""What the engine builds, decided from the optimizer's groups, dtypes, the world size and the config alone.

A pure module (no tensors, no process group): the runtimes allocate what these plans say, and the memory
estimator (tools/estimator.py) counts the same plans, so the two cannot disagree.

- Stages 1-2 (``plan_flat_groups``): one flat buffer per (optimizer group, dtype), laid out by `compute_layout`
  in buckets of ``min(reduce_bucket_size, allgather_bucket_size)`` elements, each padded to a multiple of the
  shard group; the reducer reduces buckets in ``reduction_order`` (model order, reversed).
- Stage 3 (``plan_units``): one unit per (owner, optimizer group, dtype) of each owner's own parameters, where
  an owner is a block (stage3/block_units.py: all the modules of its subtree) or a module outside blocks (a
  tied parameter belongs to the first module that registers it), parameters under
  ``param_persistence_threshold`` in a unit apart, laid out in buckets of ``reduce_bucket_size``; such a unit of
  small parameters stays gathered while ``model_persistence_threshold`` lasts; gradients are reduced in buckets of ``reduce_bucket_numel`` elements.
- Scratch (buffer_pool.py): requests rounded up by ``pool_capacity``; ``*_IN_FLIGHT`` reductions kept in flight
  with ``overlap_comm``.
- Alignment (``layout_alignment``): every layout puts parameter starts and shard boundaries on multiples of
  ``shard_alignment`` elements; unset, 64 on CUDA and 1 elsewhere, so it depends on the ``device`` the runtimes
  allocate on (the estimator is told the device it estimates for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

from zero_core.layout import FlatLayout, compute_layout

if TYPE_CHECKING:
    import torch

# Reductions kept in flight while the next one starts, with overlap_comm (none without): the stage 1-2
# reducer's (GradReducer.MAX_IN_FLIGHT) and stage 3's (PartitionedParamsRuntime.MAX_IN_FLIGHT).
REPLICATED_IN_FLIGHT = 2
PARTITIONED_IN_FLIGHT = 1

# Elements parameter starts and shard boundaries are aligned to on CUDA when ``shard_alignment`` is unset:
# 128 bytes for 16-bit parameters (a global-memory transaction, Megatron's parameter alignment), 256 bytes for
# fp32. Every shard then starts on such a boundary, so NCCL's collectives and the kernels over shards read
# aligned memory. CPU layouts stay packed (1): gloo and CPU kernels gain nothing from it.
CUDA_ALIGNMENT = 64

Device = Union["torch.device", str, None]  # where the runtime allocates ("cuda:0", ...); None: the CPU


def layout_alignment(config, device: Device = None) -> int:
    """The alignment, in elements, of the layouts planned for parameters allocated on ``device``:
    ``config.shard_alignment`` when set, else ``CUDA_ALIGNMENT`` on CUDA and 1 elsewhere."""
    if config.shard_alignment is not None:
        return config.shard_alignment
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    return CUDA_ALIGNMENT if kind == "cuda" else 1


@dataclass(frozen=True)
class ParamSpec:
    """What planning reads of one parameter."""

    numel: int
    dtype: str  # str(torch.dtype) before any cast: parameters of different dtypes never share a buffer
    group: Optional[int] = None  # optimizer group index (across all optimizers); None: frozen or in no group
    module: str = ""  # stage 3's unit owner: the first module that registers it, or that module's block

    @property
    def group_key(self) -> int:
        return -1 if self.group is None else self.group


@dataclass(frozen=True)
class FlatGroupPlan:
    """Stages 1-2: one optimizer group's trainable parameters of one dtype, in one flat buffer."""

    group_index: int
    dtype: str
    members: tuple[int, ...]  # indices into the parameter list the plan was made from, in buffer order
    layout: FlatLayout


@dataclass(frozen=True)
class UnitPlan:
    """Stage 3: one owner's (a block's or a module's) parameters of one optimizer group (None: frozen) and dtype."""

    module: str
    group_index: Optional[int]
    dtype: str
    members: tuple[int, ...]  # indices into the parameter list the plan was made from, in unit order
    layout: FlatLayout
    persistent: bool

    @property
    def trainable(self) -> bool:
        return self.group_index is not None


@dataclass(frozen=True)
class ReplicatedPlan:
    groups: tuple[FlatGroupPlan, ...]
    bucket_numel: int

    @property
    def pool_largest(self) -> int:
        """The scratch pool's largest size class: the largest bucket (ReplicatedParamsRuntime._largest_bucket)."""
        return max((b.range.size for g in self.groups for b in g.layout.buckets), default=1)


@dataclass(frozen=True)
class PartitionedPlan:
    units: tuple[UnitPlan, ...]
    reduce_bucket_numel: int  # elements of one coalesced gradient reduce-scatter buffer (and the pool's size)


def flat_bucket_numel(config) -> int:
    """Stages 1-2 cut their flat buffers in buckets of this many elements (reduced and gathered one at a time)."""
    return min(config.reduce_bucket_size, config.allgather_bucket_size)


def plan_flat_groups(group_index: int, dtypes: Sequence[str], numels: Sequence[int], world_size: int,
                     config, device: Device = None) -> list[FlatGroupPlan]:
    """One flat buffer per dtype (in ``str`` order) of optimizer group ``group_index``'s trainable parameters,
    given in the group's order by their ``dtypes`` and ``numels``, allocated on ``device``."""
    plans = []
    for dtype in sorted(set(dtypes)):
        members = tuple(i for i, d in enumerate(dtypes) if d == dtype)
        layout = compute_layout([numels[i] for i in members], world_size, flat_bucket_numel(config),
                                layout_alignment(config, device))
        plans.append(FlatGroupPlan(group_index, dtype, members, layout))
    return plans


def plan_replicated(trainable_by_group: Sequence[Sequence[ParamSpec]], world_size: int, config,
                    device: Device = None) -> ReplicatedPlan:
    """Every optimizer group's flat buffers, group by group; ``members`` index into that group's list."""
    groups = [plan for index, specs in enumerate(trainable_by_group)
              for plan in plan_flat_groups(index, [s.dtype for s in specs], [s.numel for s in specs], world_size,
                                           config, device)]
    return ReplicatedPlan(tuple(groups), flat_bucket_numel(config))


def reduction_order(bucket_positions: Sequence[tuple[object, int, Sequence[int]]]) -> list[tuple[object, int]]:
    """Stages 1-2 reduce buckets from the end of this order: (group, bucket) sorted by the smallest model position
    of their parameters, since backward produces gradients in roughly reverse model order, across optimizer
    groups. ``bucket_positions``: (group, bucket index, model positions of its parameters) in group order."""
    ordered = sorted(bucket_positions, key=lambda entry: min(entry[2], default=-1))
    return [(group, bucket) for group, bucket, _ in ordered]


def plan_units(modules: Sequence[tuple[str, Sequence[ParamSpec]]], world_size: int, config,
               device: Device = None) -> PartitionedPlan:
    """Stage 3's units in model order. ``modules``: each owner's name (block_units.unit_owners) and its
    parameters not registered by an earlier owner; ``members`` index into the concatenation of those lists."""
    units = []
    budget = config.model_persistence_threshold
    start = 0
    small = config.param_persistence_threshold
    for module_name, specs in modules:
        # Parameters under the persistence threshold form a unit of their own (DeepSpeed's rule is per
        # parameter): a block's norms and biases stay gathered while its large matrices are partitioned.
        keys = [(s.group_key, s.dtype, s.numel < small) for s in specs]
        for key in sorted(set(keys)):
            members = tuple(start + i for i, k in enumerate(keys) if k == key)
            numels = [specs[i - start].numel for i in members]
            persistent = key[2] and sum(numels) <= budget
            if persistent:
                budget -= sum(numels)
            layout = unit_layout(numels, world_size, config, device)
            units.append(UnitPlan(module_name, key[0] if key[0] >= 0 else None, key[1], members, layout, persistent))
        start += len(specs)
    return PartitionedPlan(tuple(units), reduce_bucket_numel([u.layout.total for u in units if u.trainable], config))


def unit_layout(numels: Sequence[int], world_size: int, config, device: Device = None) -> FlatLayout:
    """A stage 3 unit's layout: its own buckets of ``reduce_bucket_size`` elements, padded on their own."""
    return compute_layout(numels, world_size, config.reduce_bucket_size, layout_alignment(config, device))


def reduce_bucket_numel(trainable_unit_numels: Sequence[int], config) -> int:
    """Elements of stage 3's coalesced reduce-scatter: ``reduce_bucket_size``, or what the trainable units hold if
    less, or ``max_live_parameters`` if less (a run tuned for the least memory keeps its gradient scratch small
    too); never less than the largest unit (padded)."""
    total = sum(trainable_unit_numels)
    largest = max(trainable_unit_numels, default=1)
    return max(largest, min(config.reduce_bucket_size, total, config.max_live_parameters), 1)


def pool_capacity(numel: int, largest: int) -> int:
    """The size class a scratch request of ``numel`` elements gets: the next power of two, capped at ``largest``
    (so a buffer is at most twice what was asked and sizes repeat across buckets and steps)."""
    return min(1 << max(int(numel) - 1, 0).bit_length(), largest)


def step_tile_numel(config) -> int:
    """At most this many gradient elements are copied to fp32 at once in a step (``sub_group_size``, bounded by
    ``reduce_bucket_size``): the fp32 copy of 16-bit gradients is made and stepped tile by tile."""
    return max(1, min(config.sub_group_size, config.reduce_bucket_size))
