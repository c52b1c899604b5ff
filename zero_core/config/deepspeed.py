"""DeepSpeed's way of writing a ZeRO config, turned into ZeroConfig keyword arguments: the section and top-level
key names, aliases (stage3_*), deprecated names (cpu_offload, ...), "auto" values and whole DeepSpeed configs.

It knows DeepSpeed's key names but not the field types; the schema owns the dataclasses and passes field names in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from zero_core.config.errors import ZeroConfigError, did_you_mean, require_str_keys, type_error, unknown_key_error, warn

ZERO_SECTION = "zero_optimization"

# Fields that sit at the top level of a DeepSpeed config rather than inside zero_optimization.
RUN_FIELDS = ("fp16", "bf16", "gradient_clipping", "gradient_accumulation_steps", "aio", "checkpoint",
              "activation_checkpointing")

# DeepSpeed's other name for a field -> the field (same meaning, no warning).
ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "bfloat16": "bf16",
}

# Deprecated zero_optimization keys -> what to write instead (they still work, with a FutureWarning).
DEPRECATED = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "offload_param.pin_memory / offload_optimizer.pin_memory",
    "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
}

# Top-level keys of a whole DeepSpeed config that belong to other DeepSpeed features; ignored here.
DEEPSPEED_IGNORED_KEYS = frozenset({
    "amp", "autotuning", "comet", "comms_logger",
    "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last",
    "disable_allgather", "dump_state", "eigenvalue", "elasticity", "flops_profiler",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "memory_breakdown", "nebula",
    "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop", "quantize_training",
    "scheduler", "seq_parallel_communication_data_type", "sparse_attention", "sparse_gradients",
    "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallel_",
    "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
})

_OUR_TOP_KEYS = (ZERO_SECTION, *RUN_FIELDS, "bfloat16")
_OFFLOAD_BLOCKS = ("offload_param", "offload_optimizer")


def key_path(name: str) -> str:
    """Dotted path of a ZeroConfig field (or alias) as it is written in a whole DeepSpeed config."""
    root = name.split(".", 1)[0]
    return name if root in _OUR_TOP_KEYS else f"{ZERO_SECTION}.{name}"


# ----------------------------------------------------------------------------- key names


def normalize_names(kwargs: Mapping, field_names: Iterable[str]) -> dict:
    """Map aliases and deprecated names of a flat ZeroConfig mapping to field names; reject unknown keys."""
    out = dict(kwargs)
    for old, new in ALIASES.items():
        _rename(out, old, new)
    _apply_deprecated(out)
    field_names = tuple(field_names)
    for key in out:
        if key not in field_names:
            top_level = did_you_mean(key, field_names) in RUN_FIELDS  # report it where it belongs
            raise unknown_key_error(key if top_level else f"{ZERO_SECTION}.{key}", key, field_names)
    return out


def _rename(out: dict, old: str, new: str) -> None:
    if old not in out:
        return
    if new in out:
        raise ZeroConfigError(
            f"{key_path(old)} and {key_path(new)} name the same field; keep only {new!r}")
    out[new] = out.pop(old)


def _apply_deprecated(out: dict) -> None:
    _deprecated_offload(out, "cpu_offload", "offload_optimizer")
    _deprecated_offload(out, "cpu_offload_param", "offload_param")
    _deprecated_pin_memory(out)
    old = "stage3_gather_fp16_weights_on_model_save"
    if old in out:
        _warn_deprecated(old, f"{key_path('gather_16bit_weights_on_model_save')}")
        _rename(out, old, "gather_16bit_weights_on_model_save")


def _warn_deprecated(old: str, instead: str, note: str = "") -> None:
    warn(f"{key_path(old)} is deprecated; use {instead} instead{note}", FutureWarning)


def _require_bool(path: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise type_error(path, "true or false", value)


def _deprecated_offload(out: dict, old: str, new: str) -> None:
    """DeepSpeed's `cpu_offload: true` means an offload block on the CPU; false means no block."""
    if old not in out:
        return
    value = out.pop(old)
    _warn_deprecated(old, f"{key_path(new)} = {{'device': 'cpu'}}")
    if value is None:  # DeepSpeed's default for the old key: not set
        return
    _require_bool(key_path(old), value)
    if new in out:
        raise ZeroConfigError(f"{key_path(old)} and {key_path(new)} are both set; keep only {new!r}")
    out[new] = {"device": "cpu"} if value else None


def _deprecated_pin_memory(out: dict) -> None:
    old = "cpu_offload_use_pin_memory"
    if old not in out:
        return
    value = out.pop(old)
    blocks = [name for name in _OFFLOAD_BLOCKS if out.get(name) is not None]
    note = "" if blocks else " (no offload block is set, so it has no effect)"
    _warn_deprecated(old, " / ".join(f"{key_path(b)}.pin_memory" for b in _OFFLOAD_BLOCKS), note)
    if value is None:
        return
    _require_bool(key_path(old), value)
    for name in blocks:
        out[name] = _with_pin_memory(out[name], value)


def _with_pin_memory(block: Any, value: bool) -> Any:
    """A pin_memory written inside the block itself wins over the deprecated top-level switch."""
    if isinstance(block, Mapping):
        return {"pin_memory": value, **block}
    if dataclasses.is_dataclass(block) and not isinstance(block, type):
        return dataclasses.replace(block, pin_memory=value)
    return block  # not a block at all; field validation reports it


# ----------------------------------------------------------------------------- "auto"


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def pop_autos(kwargs: dict, nested: Mapping[str, Iterable[str]]) -> tuple[dict, tuple[str, ...]]:
    """Drop "auto" values (fields then keep their defaults) and return their field paths.

    `nested` maps a block field (fp16, offload_param, ...) to its own field names; only known keys
    count, so a misspelt key set to "auto" still reaches the unknown-key check.
    """
    out, autos = {}, []
    for key, value in kwargs.items():
        if is_auto(value):
            autos.append(key)
            continue
        if key in nested and isinstance(value, Mapping):
            value = dict(value)
            for inner in [k for k, v in value.items() if k in set(nested[key]) and is_auto(v)]:
                del value[inner]
                autos.append(f"{key}.{inner}")
        out[key] = value
    return out, tuple(autos)


# ----------------------------------------------------------------------------- whole DeepSpeed configs


def is_whole_config(d: Mapping) -> bool:
    """A whole DeepSpeed config has zero_optimization, or a key only DeepSpeed's top level has
    (a config with ZeRO off may lack zero_optimization but still carry optimizer, ...)."""
    return ZERO_SECTION in d or any(key in DEEPSPEED_IGNORED_KEYS for key in d)


def flatten_deepspeed_config(d: Mapping, zero_names: Iterable[str]) -> dict:
    """Turn a whole DeepSpeed config into ZeroConfig keyword arguments (zero block + run fields)."""
    zero_names = set(zero_names)
    require_str_keys(d)
    for key in d:
        if key not in _OUR_TOP_KEYS and key not in DEEPSPEED_IGNORED_KEYS:
            raise _unknown_top_level(key, zero_names)
    zero = d.get(ZERO_SECTION)
    if zero is None:
        zero = {}
    if not isinstance(zero, Mapping):
        raise ZeroConfigError(f"{ZERO_SECTION} must be a mapping of ZeRO settings, got {zero!r}")
    require_str_keys(zero, ZERO_SECTION)
    for key in zero:
        if key in _OUR_TOP_KEYS:
            raise ZeroConfigError(f"'{ZERO_SECTION}.{key}' belongs at the top level of the DeepSpeed "
                                  f"config, next to '{ZERO_SECTION}'; move it there")
    flat = dict(zero)
    flat.update({key: d[key] for key in (*RUN_FIELDS, "bfloat16") if key in d})
    return flat


def _unknown_top_level(key: str, zero_names: set) -> ZeroConfigError:
    if key in zero_names or key in ALIASES or key in DEPRECATED:
        return ZeroConfigError(
            f"unknown top-level key {key!r}: it belongs inside '{ZERO_SECTION}'; move it there")
    return unknown_key_error(key, key, (*_OUR_TOP_KEYS, *DEEPSPEED_IGNORED_KEYS))
