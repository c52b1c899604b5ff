"""Which engine manages a parameter.

DeepSpeed's debugging API (``safe_get_full_fp32_param(param)`` and friends) is called with a bare parameter,
so some lookup from parameter to engine must exist. We keep it here, in one weak map, instead of hanging
attributes on the user's ``nn.Parameter`` objects; entries vanish with their parameters.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Keyed by identity: tensors compare element-wise, so an ordinary weak dictionary cannot hold them.
_ENGINES = WeakIdKeyDictionary()


def register(params, engine) -> None:
    for param in params:
        _ENGINES[param] = engine


def engine_of(param: torch.Tensor):
    """The engine managing ``param``; a clear error if there is none."""
    engine = _ENGINES.get(param) if isinstance(param, torch.Tensor) else None
    if engine is None:
        raise ValueError(
            f"this parameter (shape {tuple(getattr(param, 'shape', ()))}) is not managed by a zero_core engine: "
            "pass a parameter of the model given to zero_core.setup"
        )
    return engine
