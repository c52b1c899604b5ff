"""The keyword arguments a Lightning ``DeepSpeedStrategy`` user brings (``allgather_bucket_size``,
``stage3_param_persistence_threshold``, ``loss_scale``, ...), written into the same ``ZeroConfig`` fields a
``config=`` would set. ``config=`` stays the full form; a keyword and the config that both state a field must
agree, else the error names both.

The strategies list these keywords in their own signatures (not ``**kwargs``) so that LightningCLI's
jsonargparse sees, types and documents each one.
"""

from __future__ import annotations

from typing import Any

from zero_core import ZeroConfig

# zero_optimization fields, under DeepSpeed's names; None means "not given" (the config's value stays).
ZERO_KEYWORDS = (
    "allgather_bucket_size", "reduce_bucket_size", "allgather_partitions", "reduce_scatter", "overlap_comm",
    "contiguous_gradients", "sub_group_size", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance",
)
# DeepSpeedStrategy's loss-scaling keywords: the fp16 block's fields of the same names.
FP16_KEYWORDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
KEYWORDS = ZERO_KEYWORDS + FP16_KEYWORDS


def given_keywords(arguments: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed keywords among a constructor's ``locals()`` that the user set (not None)."""
    return {name: arguments[name] for name in KEYWORDS if arguments.get(name) is not None}


def apply_deepspeed_args(config: ZeroConfig, given: dict[str, Any], owner: str = "ZeroStrategy") -> ZeroConfig:
    """``config`` with each given keyword written into its field (checked as the config's own values are)."""
    zero = {k: v for k, v in given.items() if k in ZERO_KEYWORDS}
    fp16 = {k: v for k, v in given.items() if k in FP16_KEYWORDS}
    parsed = ZeroConfig(**zero)  # checks types and ranges; "both names given" is an error here too
    for name in zero:
        field = name.removeprefix("stage3_")  # DeepSpeed's stage3_* aliases name the same fields
        _set(config, field, getattr(parsed, field), field in config.explicit_fields(), owner, name,
             f"zero_optimization.{field}")
        config.mark_given(field)
    block, defaults = ZeroConfig(fp16=fp16).fp16, ZeroConfig().fp16  # checked like the config's own values
    for field in fp16:
        # The fp16 block does not record which fields were written; a value away from the default was.
        stated = getattr(config.fp16, field) != getattr(defaults, field)
        _set(config.fp16, field, getattr(block, field), stated, owner, field, f"fp16.{field}")
        config.mark_given("fp16")
    config.validate()
    return config


def _set(target: Any, field: str, value: Any, stated: bool, owner: str, keyword: str, path: str) -> None:
    current = getattr(target, field)
    if stated and current != value:
        raise ValueError(f"{owner}({keyword}={value!r}) contradicts the config's {path}={current!r}; give it in "
                         "one place (the keyword, or the config)")
    setattr(target, field, value)
