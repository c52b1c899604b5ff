"""Predict per-rank memory of ZeRO training without a process group: ``estimate_memory(model, config, world_size)``.

The formulas are the ZeRO paper's (section 3, table 1). Given a model (and its optimizer's parameter groups), the
estimate counts the plans the engine allocates from (zero_core/planning.py, counted in tools/plan_memory.py), so
every class equals ``engine.memory_stats()`` after a step. Model states per rank, with Ψ trainable elements,
N ranks, p / g bytes per parameter / gradient element and K bytes of optimizer state per element:

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

from zero_core.arg_checks import check_parameter
from zero_core.config import ZeroConfig
from zero_core.planning import step_tile_numel
from zero_core.tools.plan_memory import for_device, hpz_secondary_bytes, rank_bytes

PRECISIONS = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
# Adam and AdamW keep two fp32 moments per element (exp_avg, exp_avg_sq) and a 4-byte `step` tensor per
# parameter: the engine's optimizer parameters are master pieces, one per parameter fragment a rank owns.
ADAM_STATE_BYTES = 8
ADAM_TENSOR_BYTES = 4
_DTYPE_OF_SIZE = {8: "torch.float64", 4: "torch.float32", 2: "torch.float16", 1: "torch.uint8"}


@dataclass(frozen=True)
class ParamInfo:
    """What the estimator reads of one parameter: its size, element size and owner (the module that registers it
    first, or that module's block: stage 3 plans units per owner, block_units.unit_owners), and its optimizer
    group (``None``: in no group, left whole and untouched by the engine). ``dtype`` is ``str(torch.dtype)``;
    by default the float type of ``element_size``."""

    numel: int
    element_size: int
    trainable: bool = True
    module: str = ""
    group: Optional[int] = 0
    dtype: str = ""
    floating: bool = True
    tile: bool = False  # owned by a TiledLinear tile: gathered alone, at most one more tile ahead

    def __post_init__(self) -> None:
        if not self.dtype:
            object.__setattr__(self, "dtype", _DTYPE_OF_SIZE.get(self.element_size, f"{self.element_size}-byte"))


@dataclass(frozen=True)
class ModelInfo:
    """The parameters (each tied weight once) and buffers of a model, in registration order.

    ``floating_buffers``: (numel, element size) of each floating buffer (cast with the parameters under
    fp16/bf16); ``group_count``: the optimizer's groups (at least one more than the largest ``group``)."""

    params: tuple[ParamInfo, ...]
    buffer_bytes: int = 0
    floating_buffers: tuple[tuple[int, int], ...] = ()
    group_count: int = 0

    def __post_init__(self) -> None:
        used = max((p.group + 1 for p in self.params if p.group is not None), default=1)
        object.__setattr__(self, "group_count", max(self.group_count, used))

    @property
    def trainable_numel(self) -> int:
        """Ψ: the elements the optimizer updates (requires_grad, in an optimizer group)."""
        return sum(p.numel for p in self.params if p.trainable and p.group is not None)

    @property
    def frozen_numel(self) -> int:
        return sum(p.numel for p in self.params) - self.trainable_numel


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by class, for one stage, world size and precision.

    ``params``, ``grads``, ``fp32_master``, ``optimizer_state`` and ``buffers`` (module buffers plus the
    engine's bucket scratch) are the classes of ``ZeroEngine.memory_stats()`` after a step. Two transients are
    not held after a step and so not in ``memory_stats()``: ``live_params``, the stage 3 parameters gathered at
    one time besides the persistent ones (at most ``max_live_parameters``, at least the largest unit), and
    ``step_tile``, the fp32 copy of one tile of 16-bit gradients while the optimizer steps
    (``min(sub_group_size, reduce_bucket_size)`` elements at most, or one bigger piece). ``total`` adds the larger
    of the two, since they are never held together. ``rank`` is the rank estimated (None: the most any rank
    holds, class by class).
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
    step_tile: int = 0
    rank: Optional[int] = None

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.fp32_master + self.optimizer_state

    @property
    def total(self) -> int:
        return self.model_states + self.buffers + max(self.live_params, self.step_tile)

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


def model_info(model, trainable_only: bool = False, param_groups=None) -> ModelInfo:
    """Read a module's parameters and buffers; works on the meta device (nothing is allocated).

    ``param_groups``: the optimizer (or its ``param_groups``: dicts with ``params``, or lists of parameters)
    the engine will be set up with; by default one group of every parameter."""
    from zero_core.stage3.block_units import unit_owners
    from zero_core.stage3.leaf_modules import leaf_of
    from zero_core.stage3.tile_units import tile_of

    unit_owner = unit_owners(model)  # stage 3 plans a block's modules as one owner (as the runtime does)
    tiled = {id(p) for tile in set(tile_of(model, leaf_of(model)).values()) for p in tile.parameters()}
    owner = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), unit_owner[module_name])
    group_of, count = _group_of(model, param_groups)
    params = []
    for param in model.parameters():  # each tied Parameter once
        if trainable_only and not param.requires_grad:
            continue
        params.append(ParamInfo(param.numel(), param.element_size(), param.requires_grad, owner.get(id(param), ""),
                                group_of(param), str(param.dtype), param.is_floating_point(), id(param) in tiled))
    buffers = list(model.buffers())
    return ModelInfo(tuple(params), sum(b.numel() * b.element_size() for b in buffers),
                     tuple((b.numel(), b.element_size()) for b in buffers if b.is_floating_point()), count)


def _group_of(model, param_groups):
    """(parameter -> its group index or None, number of groups), checked as the engine checks them."""
    if param_groups is None:
        return (lambda param: 0), 1
    groups = getattr(param_groups, "param_groups", param_groups)  # an optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    index_of: dict[int, int] = {}
    for index, group in enumerate(groups):
        params = group["params"] if isinstance(group, dict) else group
        params = [params] if hasattr(params, "shape") else list(params)
        for position, param in enumerate(params):
            where = f"param_groups[{index}]" + ("['params']" if isinstance(group, dict) else "")
            check_parameter(param, "zero_core.tools.estimator", f"{where}[{position}]")
            if id(param) not in names:
                raise ValueError(f"param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                                 "in the model; build the groups from model.parameters()")
            if id(param) in index_of:
                raise ValueError(f"parameter '{names[id(param)]}' is in param_groups {index_of[id(param)]} and "
                                 f"{index}; give each parameter to one group only")
            index_of[id(param)] = index
    return (lambda param: index_of.get(id(param))), len(groups)


def estimate_memory(
    model_or_numel,
    config: Union[ZeroConfig, dict, str, None] = None,
    world_size: int = 1,
    *,
    stages: Optional[Iterable[int]] = None,
    precision: Optional[str] = None,
    optimizer_state_bytes: int = ADAM_STATE_BYTES,
    optimizer_tensor_bytes: int = ADAM_TENSOR_BYTES,
    param_groups=None,
    rank: Optional[int] = None,
    device: str = "cpu",
) -> list[MemoryEstimate]:
    """Per-rank bytes for each stage (default: 0-3) of a model (``nn.Module`` or `ModelInfo`) or a count.

    ``precision`` defaults to the config's (fp16 / bf16 when enabled there, else fp32). With a model, the
    engine's plans are counted (zero_core/planning.py): flat buffers per optimizer group and dtype, stage 3
    units, padding, scratch pools; ``param_groups`` (the optimizer, or its groups) splits the parameters as the
    optimizer will (default: one group), and ``rank`` picks the rank (default: the most any rank holds, by
    class). With a count, shards are ``ceil(Ψ / N)`` and no buffers are estimated.
    ``optimizer_state_bytes`` are per element, ``optimizer_tensor_bytes`` per optimizer parameter (Adam's
    ``step``: 4; the engine's optimizer parameters are one master piece per parameter fragment of a rank).
    ``device`` is where the engine will hold the parameters: with ``shard_alignment`` unset, layouts on "cuda"
    are aligned to 64 elements (planning.layout_alignment), on "cpu" packed.
    """
    cfg = for_device(ZeroConfig.coerce(config), device)
    precision = _resolve_precision(precision, cfg)
    _check_world_size(world_size)
    info = _as_model_info(model_or_numel, param_groups)
    stages = tuple(STAGES if stages is None else stages)
    for stage in stages:
        _check_stage(stage)
    if optimizer_tensor_bytes < 0:
        raise ValueError(f"optimizer_tensor_bytes must be >= 0, got {optimizer_tensor_bytes}")
    if rank is not None and not 0 <= rank < _shard_ranks(cfg, world_size):
        raise ValueError(f"rank must be in [0, {_shard_ranks(cfg, world_size)}) (the shard group), got {rank!r}")
    return [_estimate_stage(info, cfg, world_size, stage, precision, optimizer_state_bytes, optimizer_tensor_bytes,
                            rank) for stage in stages]


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


def _estimate_stage(info, cfg: ZeroConfig, world: int, stage: int, precision: str, k_bytes: int, tensor_bytes: int,
                    rank: Optional[int]) -> MemoryEstimate:
    n = _shard_ranks(cfg, world)
    if isinstance(info, int) or stage == 0:
        return _paper_stage(info, cfg, world, n, stage, precision, k_bytes)
    held = rank_bytes(info, cfg, n, stage, precision, k_bytes, tensor_bytes, rank)
    # hpZ: each gathered (non-persistent) unit's 1/R slice, kept from the forward to the step
    secondary = hpz_secondary_bytes(info, cfg, n, precision) if stage == 3 and cfg.zero_hpz_partition_size > 1 else 0
    return MemoryEstimate(
        stage=stage, world_size=world, precision=precision, numel=info.trainable_numel,
        params=held.params + secondary, grads=held.grads, fp32_master=held.fp32_master,
        optimizer_state=held.optimizer_state, buffers=held.buffers, live_params=held.live_params,
        shard_numel=held.shard_numel, step_tile=held.step_tile, rank=rank,
    )


def _paper_stage(info, cfg: ZeroConfig, world: int, n: int, stage: int, precision: str, k_bytes: int):
    """The paper's formulas: a parameter count (shards of ceil(Ψ/N), no buffers), or stage 0 (plain DDP) of a
    model. The step tile of a count is its upper bound, ``min(step_tile_numel, shard)`` 16-bit elements."""
    p, g, _ = _element_bytes(precision, k_bytes)
    master = 0 if precision == "fp32" else 4  # fp32 training steps the parameters themselves
    if isinstance(info, int):
        full, frozen, buffers = info, 0, 0
    else:
        full, frozen, buffers = info.trainable_numel, info.frozen_numel, info.buffer_bytes
    shard = full if stage == 0 else math.ceil(full / n)
    resident = shard if stage == 3 else full
    grads = full if stage < 2 else shard
    tile = min(step_tile_numel(cfg), shard) * 4 if stage and precision != "fp32" else 0
    live = min(full, cfg.max_live_parameters) if stage == 3 else 0
    return MemoryEstimate(
        stage=stage, world_size=world, precision=precision, numel=full, params=(resident + frozen) * p,
        grads=grads * g, fp32_master=shard * master, optimizer_state=shard * k_bytes, buffers=buffers,
        live_params=live * p, shard_numel=shard, step_tile=tile,
    )


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


def _as_model_info(model_or_numel, param_groups=None) -> Union[ModelInfo, int]:
    if param_groups is not None and not hasattr(model_or_numel, "named_modules"):
        raise TypeError("param_groups needs the model itself (an nn.Module); a ModelInfo carries each parameter's "
                        "group in ParamInfo.group")
    if isinstance(model_or_numel, ModelInfo):
        return model_or_numel
    if isinstance(model_or_numel, bool):
        raise TypeError("expected an nn.Module, a ModelInfo or a parameter count, got a bool")
    if isinstance(model_or_numel, (int, float)):
        if model_or_numel < 0 or model_or_numel != int(model_or_numel):
            raise ValueError(f"the parameter count must be a whole number >= 0, got {model_or_numel!r}")
        return int(model_or_numel)
    if hasattr(model_or_numel, "named_modules") and hasattr(model_or_numel, "parameters"):
        return model_info(model_or_numel, param_groups=param_groups)
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
            "model states", "bytes/param", "buffers", "live params", "step tile", "total"]
    lines = [f"sizes in {unit}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for e in estimates:
        sizes = [e.params, e.grads, e.fp32_master, e.optimizer_state, e.model_states]
        cells = [str(e.stage), str(e.world_size), e.precision] + [_fmt(b / scale) for b in sizes]
        cells += [f"{e.per_param():.2f}"] + [_fmt(b / scale) for b in (e.buffers, e.live_params, e.step_tile, e.total)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"
