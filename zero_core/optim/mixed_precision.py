"""Casting a model and its inputs to the 16-bit training dtype."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map


def cast_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters and buffers in place; the Parameter objects stay the same."""
    module.to(dtype)


def cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating buffers only (stage 3 casts parameters itself, unit by unit, as it partitions them)."""
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[name] = buffer.to(dtype)


def cast_floating_inputs(dtype: torch.dtype) -> Callable:
    """A forward pre-hook (with kwargs) that casts floating tensor inputs to ``dtype`` (fp16 ``auto_cast``)."""

    def cast(value):
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
