"""Who manages a parameter: an engine, or (before setup) a ``zero_core.Init`` partition.

DeepSpeed's debugging API (``safe_get_full_fp32_param(param)`` and friends) is called with a bare parameter, and
a partitioned parameter's error must name it, so some lookup from parameter to owner must exist. We keep it
here, in weak identity maps, instead of hanging attributes on the user's ``nn.Parameter`` objects; entries
vanish with their parameters. Engines and Init partitions register in separate maps, so a caller asks for the
kind it needs (zero_core/contracts.py) instead of probing the owner's attributes. A parameter handed from an
Init partition to an engine belongs to the engine only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zero_core.contracts import ParamOwner, PendingPartition

if TYPE_CHECKING:
    from zero_core.engine import ZeroEngine

# Keyed by identity: tensors compare element-wise, so an ordinary weak dictionary cannot hold them. An engine
# is held weakly too: it holds its parameters, so a strong value would keep both alive for the life of the
# process (a dropped engine's GPU memory never freed). An Init partition is held strongly: until an engine
# takes its parameters over, it alone holds their shards.
_ENGINES = WeakIdKeyDictionary()
_PENDING = WeakIdKeyDictionary()


def _lookup(table: WeakIdKeyDictionary, param: torch.Tensor):
    ref = table.get(param)
    return ref() if ref is not None else None


def register(params, engine: "ZeroEngine") -> None:
    """``params`` train under ``engine`` (from now on, whatever partition built them)."""
    for param in params:
        _PENDING.pop(param, None)
        _ENGINES[param] = weakref.ref(engine)


def register_pending(params, partition: PendingPartition) -> None:
    """``params`` were partitioned by a ``zero_core.Init`` context and await an engine."""
    for param in params:
        _PENDING[param] = partition


def owner_of(param: torch.Tensor) -> Optional[ParamOwner]:
    if not isinstance(param, torch.Tensor):
        return None
    engine = _lookup(_ENGINES, param)
    return engine if engine is not None else _PENDING.get(param)


def pending_partition_of(param: torch.Tensor) -> Optional[PendingPartition]:
    """The Init partition holding ``param``, if it is not under an engine yet."""
    return _PENDING.get(param) if isinstance(param, torch.Tensor) else None


def engine_of(param_or_module: Union[torch.Tensor, nn.Module]) -> Optional["ZeroEngine"]:
    """The engine training this parameter (or this module's first parameter); None if there is none."""
    if isinstance(param_or_module, nn.Module):
        param_or_module = next(param_or_module.parameters(), None)
    return _lookup(_ENGINES, param_or_module) if isinstance(param_or_module, torch.Tensor) else None


def require_engine(param: torch.Tensor) -> "ZeroEngine":
    """The engine managing ``param``; a clear error if there is none."""
    engine = engine_of(param)
    if engine is None:
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else ()
        raise ValueError(
            f"this parameter (shape {shape}) is not managed by a zero_core engine: "
            "pass a parameter of the model given to zero_core.setup"
        )
    return engine


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param``'s values are partitioned across ranks (built under ``zero_core.Init``, or trained at
    stage 3): it stays where the core placed it and is read inside ``GatheredParameters`` only."""
    from zero_core.stage3.partitioned_param import PartitionedParameter  # that module imports this one

    return isinstance(param, PartitionedParameter)
