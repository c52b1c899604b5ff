"""Lightning front-end for the ZeRO engine: ``import lightning_zero`` then ``Trainer(strategy="zero3")``.

Importing registers ``zero1``, ``zero2`` and ``zero3`` with the Trainer's and Fabric's strategy registries
(Lightning has no entry-point discovery, so the string names need this import; the class path
``lightning_zero.ZeroStrategy`` works without it). Importing twice is harmless. docs/lightning.md is the guide.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from .convert import convert_to_single_file
from .fabric import ZeroFabricStrategy
from .precision import ZeroFabricPrecision, ZeroPrecision
from .strategy import ZeroOptimizer, ZeroStrategy
from .weight_averaging import SwapInWeightsEMA

ZeroStrategy.register_strategies(_TRAINER_REGISTRY)
ZeroFabricStrategy.register_strategies(_FABRIC_REGISTRY)

__all__ = [
    "ZeroStrategy",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroFabricPrecision",
    "ZeroOptimizer",
    "convert_to_single_file",
    "SwapInWeightsEMA",
]
