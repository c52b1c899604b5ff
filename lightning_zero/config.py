"""From what a Lightning user gives (a stage, a config, Trainer flags) to the ``ZeroConfig`` the engine reads.

Two steps: ``base_config`` at construction (so a bad path or key fails when the strategy is built, not inside
the launched processes) and ``run_config`` at setup, which fills in what the Trainer decides: precision and
gradient accumulation. A value the config states explicitly and the Trainer contradicts is an error that names
both, never a silent choice.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from zero_core import ZeroConfig

CONFIG_ENV_VAR = "LIGHTNING_ZERO_CONFIG"
DEFAULT_STAGE = 3

ConfigInput = Union[ZeroConfig, Mapping[str, Any], str, "os.PathLike[str]", None]

# Lightning precision flag -> the engine's 16-bit block ("fp16" / "bf16"), None for fp32.
PRECISION_BLOCKS = {"32-true": None, "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}


def base_config(stage: Optional[int], config: ConfigInput) -> ZeroConfig:
    """The user's config (or ``$LIGHTNING_ZERO_CONFIG``), validated, with the stage settled."""
    if config is None and os.environ.get(CONFIG_ENV_VAR):
        config = os.environ[CONFIG_ENV_VAR]
    if isinstance(config, (str, os.PathLike)) and not Path(config).is_file():
        raise FileNotFoundError(
            f"ZeroStrategy(config={os.fspath(config)!r}): no such file. Pass a DeepSpeed-style .json/.yaml config "
            f"file, a dict, or a zero_core.ZeroConfig (the path may also come from ${CONFIG_ENV_VAR})"
        )
    cfg = copy.deepcopy(ZeroConfig.coerce(config))
    config_stage = cfg.stage if "stage" in cfg.explicit_fields() else None
    if stage is not None and config_stage is not None and stage != config_stage:
        raise ValueError(
            f"ZeroStrategy(stage={stage}) contradicts the config's zero_optimization.stage={config_stage}; "
            "give the stage in one place"
        )
    resolved = stage if stage is not None else (config_stage if config_stage is not None else DEFAULT_STAGE)
    if resolved not in (1, 2, 3):
        raise ValueError(f"ZeroStrategy needs ZeRO stage 1, 2 or 3, got {resolved}; for no sharding use strategy='ddp'")
    cfg.stage = resolved
    cfg.validate()
    return cfg


# Fields a second fit of the same module may change: the Trainer drives them per step.
_PER_RUN_FIELDS = {"gradient_accumulation_steps", "gradient_clipping"}


def differing_fields(engine_config: ZeroConfig, config: ZeroConfig) -> list[str]:
    """Config paths (e.g. ``zero_optimization.stage``) where ``config`` would set the engine up differently."""
    if config.auto_fields:
        config = config.resolve_auto()
    before, after = dict(_flatten(engine_config.to_dict())), dict(_flatten(config.to_dict()))
    return sorted(path for path in before.keys() | after.keys()
                  if before.get(path) != after.get(path) and path not in _PER_RUN_FIELDS)


def _flatten(tree: Mapping, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def run_config(base: ZeroConfig, precision: str, accumulate_grad_batches: int = 1) -> ZeroConfig:
    """``base`` completed with the Trainer's values; "auto" fields take them, contradictions raise."""
    if precision not in PRECISION_BLOCKS:
        raise ValueError(f"ZeroStrategy supports precision {', '.join(PRECISION_BLOCKS)}; got {precision!r}")
    wanted = PRECISION_BLOCKS[precision]
    autos = set(base.auto_fields)
    for block in ("fp16", "bf16"):
        if getattr(base, block).enabled and f"{block}.enabled" not in autos and block != wanted:
            raise ValueError(
                f"the ZeRO config sets {block}.enabled=true but the Trainer's precision is {precision!r}; pass "
                f"precision={'16-mixed' if block == 'fp16' else 'bf16-mixed'!r} or remove {block}.enabled from "
                "the config"
            )
    explicit_accumulation = "gradient_accumulation_steps" in base.explicit_fields() and \
        "gradient_accumulation_steps" not in autos
    if explicit_accumulation and base.gradient_accumulation_steps != accumulate_grad_batches:
        raise ValueError(
            f"the ZeRO config sets gradient_accumulation_steps={base.gradient_accumulation_steps} but "
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}); set it on the Trainer only"
        )
    values = {
        "fp16.enabled": wanted == "fp16",
        "bf16.enabled": wanted == "bf16",
        "gradient_accumulation_steps": accumulate_grad_batches,
        # Lightning's clipping (gradient_clip_val, configure_gradient_clipping) calls the engine itself.
        "gradient_clipping": 0.0,
    }
    cfg = base.resolve_auto(**values) if autos else copy.deepcopy(base)
    cfg.fp16.enabled = values["fp16.enabled"]
    cfg.bf16.enabled = values["bf16.enabled"]
    cfg.gradient_accumulation_steps = accumulate_grad_batches
    cfg.validate()
    return cfg
