"""How an error message shows a value the caller passed: its type, and a short repr where that reads on one line.

Shared by the argument checks at the public entry points and by the config's ``coerce``; it imports nothing of the
core, so both can use it without importing each other."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_SHORT = 60


def described(value: Any) -> str:
    """``value`` for an error message: its type, and a short repr where that is readable on one line."""
    kind = type(value).__name__ if not isinstance(value, type) else f"the class {value.__name__}"
    if isinstance(value, (nn.Module, torch.Tensor, torch.optim.Optimizer, type)):
        return kind
    text = repr(value)
    if "\n" in text or len(text) > _SHORT or text.startswith("<"):  # multi-line, long, or an address
        return kind
    return f"{kind} {text}"
