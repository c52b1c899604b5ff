"""Accelerate front-end for the ZeRO engine in ``zero_core``.

    from accelerate_zero import ZeroAccelerator as Accelerator   # the one changed line in a training script

``ZeroAccelerator`` is an ``accelerate.Accelerator`` whose ``prepare`` puts each model and its optimizer
under ``zero_core`` instead of DDP; ``ZeroPlugin`` holds the ZeRO settings (DeepSpeed's zero_optimization
names). ``accelerate-zero launch --config zero.yaml train.py`` runs a script from one YAML file holding
Accelerate's keys and a ``zero_optimization:`` block. See docs/accelerate.md.
"""

from .accelerator import ZeroAccelerator
from .export import export_accelerate_state
from .plugin import ENV_AUTOCAST, ENV_CONFIG, ENV_CONFIG_FILE, ENV_STAGE, ZeroPlugin

__all__ = [
    "ZeroAccelerator",
    "ZeroPlugin",
    "export_accelerate_state",
    "ENV_AUTOCAST",
    "ENV_CONFIG",
    "ENV_CONFIG_FILE",
    "ENV_STAGE",
]
