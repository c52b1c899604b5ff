"""How an Accelerate run's own settings combine with the ZeRO config, following Accelerate's DeepSpeed rules.

- Mixed precision comes from Accelerate (``mixed_precision=`` or the accelerate config). ``"bf16"`` turns on the
  engine's bf16 (16-bit parameters, fp32 master weights), ``"fp16"`` its fp16 with dynamic loss scaling (and
  ``auto_cast`` of inputs), ``"no"`` keeps fp32. A ZeRO config that sets ``fp16``/``bf16`` itself wins when
  Accelerate says ``"no"``; a contradiction is an error; ``"auto"`` takes Accelerate's value.
- ``gradient_accumulation_steps``: a value in the ZeRO config is used when the Accelerator was given none;
  two different values are an error.
- ``"auto"`` sizes (``reduce_bucket_size`` ...) come from a Hugging Face model's ``config.hidden_size``, as
  Accelerate does for DeepSpeed.
"""

from __future__ import annotations

import copy
from typing import Optional

from torch import nn

from zero_core import ZeroConfig, ZeroConfigError


def precision_flags(cfg: ZeroConfig, mixed_precision: str) -> dict[str, bool]:
    """``{"fp16.enabled": ..., "bf16.enabled": ...}`` for this run; raises when the two sources disagree."""
    if mixed_precision not in ("no", "fp16", "bf16"):
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not supported by accelerate_zero: use 'no', 'bf16' or 'fp16'"
        )
    wanted = {"fp16": mixed_precision == "fp16", "bf16": mixed_precision == "bf16"}
    flags = {}
    for block in ("fp16", "bf16"):
        given = block in cfg.explicit_fields() and f"{block}.enabled" not in cfg.auto_fields
        flags[block] = getattr(cfg, block).enabled if given else wanted[block]
        if given and mixed_precision != "no" and flags[block] != wanted[block]:
            raise ZeroConfigError(
                f"Accelerate's mixed_precision is {mixed_precision!r} but the ZeRO config sets {block}.enabled="
                f"{str(flags[block]).lower()}: make them agree, or write {block}: {{enabled: auto}}"
            )
    return {"fp16.enabled": flags["fp16"], "bf16.enabled": flags["bf16"]}


def accumulation_steps(cfg: ZeroConfig, accelerator_steps: int) -> int:
    """The run's gradient accumulation steps, from the Accelerator or (if it has the default 1) the config."""
    given = "gradient_accumulation_steps" in cfg.explicit_fields() and "gradient_accumulation_steps" not in cfg.auto_fields
    if not given or cfg.gradient_accumulation_steps == accelerator_steps:
        return accelerator_steps
    if accelerator_steps == 1:
        return cfg.gradient_accumulation_steps
    raise ZeroConfigError(
        f"gradient_accumulation_steps is {accelerator_steps} in the Accelerator but {cfg.gradient_accumulation_steps} "
        "in the ZeRO config: set it in one place, or write gradient_accumulation_steps: auto"
    )


def hidden_size_autos(model: nn.Module) -> dict[str, int]:
    """Accelerate's DeepSpeed sizes for ``"auto"`` buckets, from a Hugging Face model's hidden size."""
    model_config = getattr(model, "config", None)
    hidden = getattr(model_config, "hidden_size", None)
    sizes = getattr(model_config, "hidden_sizes", None)
    if hidden is None and sizes:
        hidden = max(sizes)
    if not isinstance(hidden, int):
        return {}
    return {
        "reduce_bucket_size": hidden * hidden,
        "prefetch_bucket_size": int(0.9 * hidden * hidden),
        "param_persistence_threshold": 10 * hidden,
    }


def run_config(
    cfg: ZeroConfig, mixed_precision: str, accumulation: int, model: Optional[nn.Module] = None
) -> ZeroConfig:
    """The config one engine is built with: precision and accumulation filled in, "auto" values resolved."""
    flags = precision_flags(cfg, mixed_precision)
    values = {**flags, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0.0}
    if model is not None:
        values.update(hidden_size_autos(model))
    out = cfg.resolve_auto(**values) if cfg.auto_fields else copy.deepcopy(cfg)
    explicit = set(cfg.explicit_fields())
    if "fp16" not in explicit and flags["fp16.enabled"]:
        out.fp16.enabled, out.fp16.auto_cast = True, True  # Accelerate's DeepSpeed plugin adds the same block
    if "bf16" not in explicit:
        out.bf16.enabled = flags["bf16.enabled"]
    if "gradient_accumulation_steps" not in explicit:
        out.gradient_accumulation_steps = accumulation
    out.validate()
    return out
