"""Predict per-rank memory of ZeRO training without a process group: ``estimate_memory(model, config, world_size)``.

The formulas are the ZeRO paper's (section 3, table 1), applied to the same `compute_layout` that the engine
allocates with, so padding is counted exactly when a model is given. Model states per rank, with Ψ trainable
elements, N ranks, p / g bytes per parameter / gradient element and K bytes of optimizer state per element:

| stage | parameters | gradients | fp32 master + optimizer state |
| --- | --- | --- | --- |
| 0 (DDP) | pΨ | gΨ | KΨ |
| 1 | pΨ | gΨ | KΨ/N |
| 2 | pΨ | gΨ/N | KΨ/N |
| 3 | pΨ/N | gΨ/N | KΨ/N |

Mixed precision (fp16/bf16) with Adam: p = g = 2, K = 4 (master) + 8 (two moments) = 12, so 16Ψ for DDP.
fp32 with Adam: p = g = 4 and the master is the parameter itself, so K = 8 and DDP needs 16Ψ as well.
With MiCS (``mics_shard_size``) N is the shard group's size (states are replicated across groups); hpZ
(``zero_hpz_partition_size`` R) adds pΨ/R of parameters in stage 3, the in-node copy held from forward to step.
docs/estimator.md explains every class and the CLI (`zero-estimate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from zero_core.config import ZeroConfig
from zero_core.comm.quantize import wire_bytes
from zero_core.layout import compute_layout

PRECISIONS = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
# Adam and AdamW keep two fp32 moments per element (exp_avg, exp_avg_sq).
ADAM_STATE_BYTES = 8
# The engine's scratch pool (buffer_pool.py) rounds every request up to a power of two, capped at the largest
# bucket (stages 1-2) or unit (stage 3), and reuses freed buffers of the same size. Backward reduces buckets or
# units last to first, keeping this many reductions in flight (MAX_IN_FLIGHT of the gradient reducers).
_IN_FLIGHT = 2


@dataclass(frozen=True)
class ParamInfo:
    """What the estimator reads of one parameter: its size, element size and owning module."""

    numel: int
    element_size: int
    trainable: bool = True
    module: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """The parameters (each tied weight once) and buffers of a model, in registration order."""

    params: tuple[ParamInfo, ...]
    buffer_bytes: int = 0

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def frozen_numel(self) -> int:
        return sum(p.numel for p in self.params if not p.trainable)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by class, for one stage, world size and precision.

    ``params``, ``grads``, ``fp32_master`` and ``optimizer_state`` are the model states, the classes of
    ``ZeroEngine.memory_stats()``. ``buffers`` are module buffers plus the engine's bucket scratch (an upper
    bound that depends on the bucket size, not on the model), ``live_params`` the stage 3 parameters gathered
    at one time besides the persistent ones (at most ``max_live_parameters``, at least the largest unit).
    """

    stage: int
    world_size: int
    precision: str
    numel: int
    params: int
    grads: int
    fp32_master: int
    optimizer_state: int
    buffers: int = 0
    live_params: int = 0
    shard_numel: int = 0  # trainable elements whose master this rank holds (placement_bytes reads it)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.fp32_master + self.optimizer_state

    @property
    def total(self) -> int:
        return self.model_states + self.buffers + self.live_params

    def per_param(self) -> float:
        """Model-state bytes divided by Ψ (the paper's unit: 16 for DDP)."""
        return self.model_states / self.numel if self.numel else 0.0


def paper_bytes_per_param(stage: int, world_size: int, precision: str = "fp16",
                          optimizer_state_bytes: int = ADAM_STATE_BYTES) -> float:
    """The paper's model-state bytes per parameter, without padding: e.g. 4 + 12/N for stage 1, mixed precision."""
    _check_stage(stage)
    _check_world_size(world_size)
    p, g, k = _element_bytes(precision, optimizer_state_bytes)
    n = world_size
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def model_info(model, trainable_only: bool = False) -> ModelInfo:
    """Read a module's parameters and buffers; works on the meta device (nothing is allocated)."""
    owner = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), module_name)
    params = []
    for param in model.parameters():  # each tied Parameter once
        if trainable_only and not param.requires_grad:
            continue
        params.append(ParamInfo(param.numel(), param.element_size(), param.requires_grad, owner.get(id(param), "")))
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return ModelInfo(tuple(params), buffer_bytes)


def estimate_memory(
    model_or_numel,
    config: Union[ZeroConfig, dict, str, None] = None,
    world_size: int = 1,
    *,
    stages: Optional[Iterable[int]] = None,
    precision: Optional[str] = None,
    optimizer_state_bytes: int = ADAM_STATE_BYTES,
) -> list[MemoryEstimate]:
    """Per-rank bytes for each stage (default: 0-3) of a model (``nn.Module`` or `ModelInfo`) or a count.

    ``precision`` defaults to the config's (fp16 / bf16 when enabled there, else fp32). With a model, the flat
    layout of the engine (buckets padded to a multiple of ``world_size``) is used; with a count, shards are
    ``ceil(Ψ / N)`` and no buffers are estimated.
    """
    cfg = ZeroConfig.coerce(config)
    precision = _resolve_precision(precision, cfg)
    _check_world_size(world_size)
    info = _as_model_info(model_or_numel)
    stages = tuple(STAGES if stages is None else stages)
    for stage in stages:
        _check_stage(stage)
    return [_estimate_stage(info, cfg, world_size, stage, precision, optimizer_state_bytes) for stage in stages]


def estimate_stage(model_or_numel, config=None, world_size: int = 1, stage: Optional[int] = None,
                   **kwargs) -> MemoryEstimate:
    """One stage's estimate; ``stage`` defaults to the config's."""
    cfg = ZeroConfig.coerce(config)
    return estimate_memory(model_or_numel, cfg, world_size, stages=[cfg.stage if stage is None else stage],
                           **kwargs)[0]


# -- the arithmetic ----------------------------------------------------------------------------------------

def _shard_ranks(cfg: ZeroConfig, n: int) -> int:
    """Ranks that partition the model states: MiCS's shard group (replicated across groups), else all."""
    if cfg.mics_shard_size in (-1, n):
        return n
    if n % cfg.mics_shard_size:
        raise ValueError(f"mics_shard_size={cfg.mics_shard_size} must divide world_size ({n})")
    return cfg.mics_shard_size


def _estimate_stage(info, cfg: ZeroConfig, world: int, stage: int, precision: str, k_bytes: int) -> MemoryEstimate:
    p, g, _ = _element_bytes(precision, k_bytes)
    master = 0 if precision == "fp32" else 4  # fp32 training steps the parameters themselves
    n = _shard_ranks(cfg, world)
    if isinstance(info, int):
        sizes = _Sizes(full=info, padded=info, shard=math.ceil(info / n))
        buffers = 0
    else:
        sizes = _stage3_sizes(info, cfg, n) if stage == 3 else _flat_sizes(info, cfg, n)
        buffers = info.buffer_bytes + (_scratch_bytes(info, cfg, n, stage) * p if stage else 0)
    if stage == 0:
        sizes = _Sizes(full=sizes.full, padded=sizes.full, shard=sizes.full, frozen=sizes.frozen)
    resident = {0: sizes.full, 1: sizes.padded, 2: sizes.padded, 3: sizes.shard + sizes.persistent}[stage]
    grads = {0: sizes.full, 1: sizes.padded, 2: sizes.shard, 3: sizes.shard}[stage]
    live = min(sizes.full, max(cfg.max_live_parameters, sizes.largest_unit)) if stage == 3 else 0
    # hpZ: each gathered (non-persistent) unit's 1/R slice, kept from the forward to the step
    secondary = sizes.gathered // cfg.zero_hpz_partition_size if stage == 3 and cfg.zero_hpz_partition_size > 1 else 0
    return MemoryEstimate(
        stage=stage, world_size=world, precision=precision, numel=sizes.full,
        params=(resident + sizes.frozen + secondary) * p + sizes.frozen_quantized_bytes, grads=grads * g, fp32_master=sizes.shard * master,
        optimizer_state=sizes.shard * k_bytes, buffers=buffers, live_params=live * p, shard_numel=sizes.shard,
    )


@dataclass(frozen=True)
class _Sizes:
    """Element counts of one rank: trainable (full, flat buffer with padding, own shard), frozen elements held,
    stage 3's persistent (always gathered) elements and its largest gathered unit."""

    full: int
    padded: int
    shard: int
    frozen: int = 0
    persistent: int = 0
    largest_unit: int = 0
    gathered: int = 0  # stage 3: padded elements of the units the hooks gather (not persistent)
    frozen_quantized_bytes: int = 0  # stage 3, zero_quantized_nontrainable_weights: frozen shards stored 8-bit


def _flat_sizes(info: ModelInfo, cfg: ZeroConfig, n: int) -> _Sizes:
    """Stages 1-2: one flat buffer per parameter dtype, cut in buckets, each padded to a multiple of N."""
    bucket = min(cfg.reduce_bucket_size, cfg.allgather_bucket_size)
    padded = shard = 0
    for layout in _flat_layouts(info, n, bucket):
        padded += layout.total
        shard += layout.shard_numel
    return _Sizes(full=info.trainable_numel, padded=padded, shard=shard, frozen=info.frozen_numel)


def _flat_layouts(info: ModelInfo, n: int, bucket: int) -> list:
    """One flat layout per parameter element size, over the trainable parameters."""
    sizes = sorted({p.element_size for p in info.params if p.trainable})
    return [compute_layout([p.numel for p in info.params if p.trainable and p.element_size == size], n, bucket)
            for size in sizes]


def _units(info: ModelInfo) -> list[tuple[bool, list[int]]]:
    """Stage 3's units in model order: one module's own parameters of one kind (trainable or not, dtype)."""
    units: dict[tuple, list[int]] = {}
    for param in info.params:
        units.setdefault((param.module, param.element_size, param.trainable), []).append(param.numel)
    return [(key[2], numels) for key, numels in units.items()]


def _stage3_sizes(info: ModelInfo, cfg: ZeroConfig, n: int) -> _Sizes:
    """Each unit has its own padded layout; a unit of parameters all under param_persistence_threshold stays
    gathered while model_persistence_threshold lasts (frozen units are sharded too, without gradients)."""
    shard = frozen = persistent = largest = gathered = quantized = 0
    budget = cfg.model_persistence_threshold
    offload = cfg.offload_param
    stores_quantized = cfg.zero_quantized_nontrainable_weights and (offload is None or offload.device == "none")
    for trainable, numels in _units(info):
        layout = compute_layout(numels, n, cfg.reduce_bucket_size)
        is_persistent = all(x < cfg.param_persistence_threshold for x in numels) and sum(numels) <= budget
        if is_persistent:
            budget -= sum(numels)
            persistent += layout.total
        else:
            largest = max(largest, layout.total)
            gathered += layout.total
        if trainable:
            shard += layout.shard_numel
        elif stores_quantized and not is_persistent:  # codes, scales and minima of each bucket's shard
            quantized += sum(wire_bytes(1, b.shard_size, 8, asymmetric=True) for b in layout.buckets)
        else:
            frozen += layout.shard_numel
    return _Sizes(full=info.trainable_numel, padded=shard * n, shard=shard, frozen=frozen, persistent=persistent,
                  largest_unit=largest, gathered=gathered, frozen_quantized_bytes=quantized)


def _scratch_bytes(info: ModelInfo, cfg: ZeroConfig, n: int, stage: int) -> int:
    """Elements of the scratch pool after a step: each reduction takes a reduce-scatter output of one shard and,
    for stages 2-3, a staging buffer of its whole bucket or unit; replayed in backward order through the pool."""
    if stage == 3:
        return _stage3_scratch(info, cfg, n)
    else:
        bucket = min(cfg.reduce_bucket_size, cfg.allgather_bucket_size)
        pieces = [(b.range.size, b.shard_size) for layout in _flat_layouts(info, n, bucket) for b in layout.buckets]
    if not pieces:
        return 0
    cap = max(whole for whole, _ in pieces)
    keep = _IN_FLIGHT if cfg.resolved_overlap_comm else 0
    return _replay_pool([[s] + ([w] if stage >= 2 else []) for w, s in reversed(pieces)], cap, keep)


def _stage3_scratch(info: ModelInfo, cfg: ZeroConfig, n: int) -> int:
    """Stage 3 reduces gradients in coalesced buckets (stage3.py ``_bucket_numel``): each bucket buffer holds
    ``min(reduce_bucket_size, the trainable units, max_live_parameters)`` elements, at least the largest unit.
    The first step reduces unit by unit (its collectives are checked), so the pool holds one bucket per unit up
    to the buckets in flight plus the one filling: two with ``overlap_comm``, one without."""
    totals = [compute_layout(numels, n, cfg.reduce_bucket_size).total for trainable, numels in _units(info)
              if trainable]
    if not totals:
        return 0
    bucket = max(max(totals), min(cfg.reduce_bucket_size, sum(totals), cfg.max_live_parameters), 1)
    return min(len(totals), 2 if cfg.resolved_overlap_comm else 1) * bucket


def _replay_pool(requests: list[list[int]], cap: int, keep: int) -> int:
    """Elements a pool allocates serving ``requests`` (one list of buffer sizes per reduction), freeing the
    oldest reduction's buffers whenever more than ``keep`` are in flight."""
    free: dict[int, int] = {}
    allocated = 0
    in_flight: list[list[int]] = []
    for sizes in requests:
        taken = [min(1 << max(numel - 1, 0).bit_length(), cap) for numel in sizes]
        for size in taken:
            if free.get(size):
                free[size] -= 1
            else:
                allocated += size
        in_flight.append(taken)
        while len(in_flight) > keep:
            for size in in_flight.pop(0):
                free[size] = free.get(size, 0) + 1
    return allocated


def _element_bytes(precision: str, k_bytes: int) -> tuple[int, int, int]:
    """(parameter bytes, gradient bytes, K) per element for one precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if k_bytes < 0:
        raise ValueError(f"optimizer_state_bytes must be >= 0, got {k_bytes}")
    if precision == "fp32":
        return 4, 4, k_bytes
    return 2, 2, k_bytes + 4  # the fp32 master copy joins the optimizer states (the paper's K = 12 for Adam)


def _resolve_precision(precision: Optional[str], cfg: ZeroConfig) -> str:
    if precision is None:
        return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _as_model_info(model_or_numel) -> Union[ModelInfo, int]:
    if isinstance(model_or_numel, ModelInfo):
        return model_or_numel
    if isinstance(model_or_numel, bool):
        raise TypeError("expected an nn.Module, a ModelInfo or a parameter count, got a bool")
    if isinstance(model_or_numel, (int, float)):
        if model_or_numel < 0 or model_or_numel != int(model_or_numel):
            raise ValueError(f"the parameter count must be a whole number >= 0, got {model_or_numel!r}")
        return int(model_or_numel)
    if hasattr(model_or_numel, "named_modules") and hasattr(model_or_numel, "parameters"):
        return model_info(model_or_numel)
    raise TypeError(f"expected an nn.Module, a ModelInfo or a parameter count, got {type(model_or_numel).__name__}")


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of 0, 1, 2, 3, got {stage!r}")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def format_table(estimates: Sequence[MemoryEstimate], unit: str = "GB") -> str:
    """A markdown table, one row per estimate, in decimal GB (the paper's unit) or another unit of UNITS."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    scale = UNITS[unit]
    head = ["stage", "world size", "precision", "params", "grads", "fp32 master", "optimizer state",
            "model states", "bytes/param", "buffers", "live params", "total"]
    lines = [f"sizes in {unit}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for e in estimates:
        sizes = [e.params, e.grads, e.fp32_master, e.optimizer_state, e.model_states]
        cells = [str(e.stage), str(e.world_size), e.precision] + [_fmt(b / scale) for b in sizes]
        cells += [f"{e.per_param():.2f}", _fmt(e.buffers / scale), _fmt(e.live_params / scale), _fmt(e.total / scale)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"
