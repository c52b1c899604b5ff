"""Accelerate's DeepSpeed-plugin offload keys in a zero.yaml, next to Accelerate's own keys:
``offload_optimizer_device``, ``offload_param_device``, ``offload_optimizer_nvme_path``, ``offload_param_nvme_path``
(the names of Accelerate's ``deepspeed_config``). They become the ``zero_optimization`` block's offload blocks."""

from __future__ import annotations

from pathlib import Path

from zero_core import ZeroConfigError

# zero.yaml key -> (zero_optimization block, field in it)
OFFLOAD_KEYS = {
    "offload_optimizer_device": ("offload_optimizer", "device"),
    "offload_optimizer_nvme_path": ("offload_optimizer", "nvme_path"),
    "offload_param_device": ("offload_param", "device"),
    "offload_param_nvme_path": ("offload_param", "nvme_path"),
}


def merge_offload_keys(path: Path, data: dict, zero: dict) -> dict:
    """Pop the offload keys from ``data`` into a copy of the ``zero`` block; a contradiction is an error."""
    zero = dict(zero)
    for key, (block, field) in OFFLOAD_KEYS.items():
        if key not in data:
            continue
        value = data.pop(key)
        current = dict(zero.get(block) or {})
        if field in current and current[field] != value:
            raise ZeroConfigError(
                f"{path}: {key}: {value!r} contradicts zero_optimization.{block}.{field}: {current[field]!r}; "
                "give it in one place"
            )
        current[field] = value
        zero[block] = current
    return zero
