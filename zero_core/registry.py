"""Who manages a parameter: an engine, or (before setup) a ``zero_core.Init`` partition.

DeepSpeed's debugging API (``safe_get_full_fp32_param(param)`` and friends) is called with a bare parameter, and
a partitioned parameter's error must name it, so some lookup from parameter to owner must exist. We keep it
here, in one weak identity map, instead of hanging attributes on the user's ``nn.Parameter`` objects; entries
vanish with their parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Keyed by identity: tensors compare element-wise, so an ordinary weak dictionary cannot hold them.
_OWNERS = WeakIdKeyDictionary()


def register(params, owner: Any) -> None:
    for param in params:
        _OWNERS[param] = owner


def owner_of(param: torch.Tensor) -> Optional[Any]:
    return _OWNERS.get(param) if isinstance(param, torch.Tensor) else None


def engine_of(param: torch.Tensor):
    """The engine managing ``param``; a clear error if there is none."""
    owner = owner_of(param)
    if owner is None or not hasattr(owner, "fragments_of"):
        raise ValueError(
            f"this parameter (shape {tuple(getattr(param, 'shape', ()))}) is not managed by a zero_core engine: "
            "pass a parameter of the model given to zero_core.setup"
        )
    return owner
