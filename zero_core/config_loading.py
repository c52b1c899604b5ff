"""Reading ZeroConfig input: key names, "auto" values, whole DeepSpeed configs, JSON/YAML files.

This module knows DeepSpeed's key names (aliases, deprecated names, top-level keys) but not the
field types; ``zero_core.config`` owns the dataclasses and passes field names in.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class ZeroConfigError(ValueError):
    """A config key, value or file that ZeroConfig cannot accept; the message names the field."""


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


# ----------------------------------------------------------------------------- messages


def _internal_frame(frame) -> bool:
    code = frame.f_code
    here = os.path.dirname(os.path.abspath(__file__))
    name = code.co_filename
    in_config = os.path.dirname(name) == here and os.path.basename(name).startswith("config")
    return in_config or (code.co_filename == "<string>" and code.co_name == "__init__")  # dataclass __init__


def warn(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside the config modules, so the warning points at user code."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _internal_frame(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def did_you_mean(key: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_error(where: str, key: str, candidates: Iterable[str]) -> ZeroConfigError:
    """`where` is the full dotted path of the bad key; the suggestion is a bare key name."""
    candidates = sorted(candidates)
    match = did_you_mean(key, candidates)
    if match:
        hint = f"; did you mean {match!r}?"
    elif len(candidates) <= 12:
        hint = f"; valid keys: {', '.join(candidates)}"
    else:
        hint = "; docs/config.md lists the valid keys"
    return ZeroConfigError(f"unknown key {where!r}{hint}")


def type_error(path: str, expected: str, value: Any) -> ZeroConfigError:
    hint = ""
    if isinstance(value, str) and value == "auto":
        hint = "; 'auto' is only understood by ZeroConfig itself (kwargs, from_dict, from_file)"
    elif isinstance(value, str) and _is_number(value):
        hint = "; write the number without quotes"
    return ZeroConfigError(f"{path} must be {expected}, got {value!r} ({type(value).__name__}){hint}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def require_str_keys(d: Mapping, where: str = "the config") -> None:
    for key in d:
        if not isinstance(key, str):
            raise ZeroConfigError(f"keys of {where} must be strings, got {key!r} ({type(key).__name__})")


def check_keys(mapping: Mapping, prefix: str, valid: Iterable[str]) -> None:
    """Raise on the first non-string or unknown key of `mapping`, whose dotted path is `prefix`."""
    valid = set(valid)
    require_str_keys(mapping, prefix)
    for key in mapping:
        if key not in valid:
            raise unknown_key_error(f"{prefix}.{key}" if prefix else key, key, valid)


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


# ----------------------------------------------------------------------------- files

SUFFIXES = (".json", ".yaml", ".yml")


def read_config_file(path: str | os.PathLike) -> Mapping:
    """Read a .json/.yaml/.yml file whose top level is a mapping; every failure names the file."""
    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise ZeroConfigError(f"config file '{p}' has suffix {p.suffix!r}; use one of {', '.join(SUFFIXES)}")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ZeroConfigError(f"config file '{p}' does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ZeroConfigError(f"cannot read config file '{p}': {err}") from None
    data = _parse_json(p, text) if p.suffix.lower() == ".json" else _parse_yaml(p, text)
    if not isinstance(data, Mapping):
        raise ZeroConfigError(f"config file '{p}' must hold a mapping at the top level, "
                              f"got {type(data).__name__}")
    return data


def _no_duplicates(pairs: list) -> dict:
    # json keeps the last duplicate silently; DeepSpeed rejects duplicates, and so do we.
    out = {}
    for key, value in pairs:
        if key in out:
            raise ZeroConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_json(p: Path, text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        raise ZeroConfigError(f"config file '{p}' is not valid JSON: {err.msg} at {where}") from None
    except ZeroConfigError as err:
        raise ZeroConfigError(f"config file '{p}' is not valid: {err}") from None


def _parse_yaml(p: Path, text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as err:
        raise ZeroConfigError(f"config file '{p}' is not valid YAML: {err}") from None


def _yaml_loader():
    """A SafeLoader that reads 5e8 as a number: YAML 1.1 wants a dot (5.0e8), DeepSpeed users don't."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    number = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", number, list("-+0123456789"))
    return Loader
