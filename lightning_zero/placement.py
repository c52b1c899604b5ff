"""Moving a partly partitioned LightningModule to its device.

A module built under ``zero_core.Init`` (``configure_model`` at stage 3) has its partitioned parameters placed
already and they cannot move; everything else it holds (torchmetrics states, modules without parameters, their
buffers) must follow the device as it does under DDP, or metrics computed on GPU outputs fail.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import zero_core


def is_partitioned(module: nn.Module) -> bool:
    """Built under ``zero_core.Init`` (or already under an engine): some of its parameters are held by the core
    (partitioned, or views of an engine's flat buffers) and must not be moved."""
    return any(zero_core.is_partitioned(p) or zero_core.engine_of(p) is not None for p in module.parameters())


def apply_around_partitioned(module: nn.Module, fn: Callable[[nn.Module], object]) -> None:
    """``fn(subtree)`` for each largest subtree of ``module`` that holds no partitioned parameter."""
    if not is_partitioned(module):
        fn(module)
        return
    for child in module.children():
        apply_around_partitioned(child, fn)


def to_device_around_partitioned(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` except for partitioned parameters, which stay where Init put them (a torchmetrics
    Metric moves its states in its own ``_apply``)."""
    apply_around_partitioned(module, lambda subtree: subtree.to(device))
