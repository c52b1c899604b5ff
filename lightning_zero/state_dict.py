"""``state_dict_type`` of the strategies: what the model's state dict is under an engine."""

from __future__ import annotations

from typing import Any, Literal

import zero_core

StateDictType = Literal["full", "sharded"]
STATE_DICT_TYPES = ("full", "sharded")


def checked_state_dict_type(value: str) -> StateDictType:
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"state_dict_type={value!r} is not supported: use 'full' (the whole model on rank 0, as FSDPStrategy "
            "gives it) or 'sharded' (no gather; the sharded checkpoint holds the weights)"
        )
    return value


def module_state_dict(engine: zero_core.ZeroEngine, state_dict_type: StateDictType) -> dict[str, Any]:
    """Every rank calls: "full" gathers (rank 0 gets the weights, the others ``{}``), "sharded" gives ``{}``."""
    if state_dict_type == "sharded":
        return {}
    return engine.full_state_dict(rank0_only=True)
