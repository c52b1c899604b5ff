"""zero_core: the shared ZeRO engine under lightning_zero and accelerate_zero.

    engine = zero_core.setup(model, optimizer, config)

See docs/core-api.md for the engine and docs/config.md for every configuration field.
"""

from .config import ZeroConfig, ZeroConfigError
from .engine import ZeroEngine, setup
from .layout import FlatLayout, Range, compute_layout

__all__ = ["ZeroConfig", "ZeroConfigError", "ZeroEngine", "setup", "FlatLayout", "Range", "compute_layout"]
