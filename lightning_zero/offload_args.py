"""``ZeroStrategy(offload_optimizer=..., offload_parameters=..., nvme_path=...)`` and the registered offload names,
written into the ZeRO config as DeepSpeed's ``offload_optimizer`` / ``offload_param`` blocks (docs/offload.md)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from zero_core import ZeroConfig

OffloadArg = Union[bool, str, None]

# Registered strategy names -> ZeroStrategy arguments (as Lightning registers deepspeed_stage_3_offload).
# "/local_nvme" is Lightning's DeepSpeedStrategy default nvme_path; zero3_offload_nvme puts the optimizer and the
# parameter shards there, as Lightning's deepspeed_stage_3_offload_nvme does.
OFFLOAD_STRATEGIES = {
    "zero2_offload": dict(stage=2, offload_optimizer="cpu"),
    "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_parameters="cpu"),
    "zero3_offload_nvme": dict(stage=3, offload_optimizer="nvme", offload_parameters="nvme", nvme_path="/local_nvme"),
}


def _device(argument: str, value: OffloadArg, nvme_path: Optional[str]) -> Optional[str]:
    if value is None or value is False:
        return None
    if value is True:
        return "nvme" if nvme_path else "cpu"
    if value in ("cpu", "nvme", "none"):
        return value
    raise ValueError(f"ZeroStrategy({argument}={value!r}): use True, False, 'cpu' or 'nvme'")


def apply_offload_args(config: ZeroConfig, offload_optimizer: OffloadArg, offload_parameters: OffloadArg,
                       nvme_path: Optional[str]) -> ZeroConfig:
    """Set the offload blocks the arguments ask for: an argument sets the block's device (and ``nvme_path``), and
    the config's other fields of that block (``max_in_cpu``, ``buffer_count``, ``pin_memory``, ...) stay; the
    config's own blocks stay whole when an argument is None."""
    for argument, field, value in (("offload_optimizer", "offload_optimizer", offload_optimizer),
                                   ("offload_parameters", "offload_param", offload_parameters)):
        device = _device(argument, value, nvme_path)
        if device is None:
            continue
        existing = getattr(config, field)
        block = {**(dataclasses.asdict(existing) if existing is not None else {}), "device": device,
                 **({"nvme_path": nvme_path} if device == "nvme" and nvme_path else {})}
        setattr(config, field, block)
        config.mark_given(field)
    config.validate()
    return config
