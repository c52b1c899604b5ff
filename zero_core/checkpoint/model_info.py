"""What the model holds, as a checkpoint sees it: trainable parameters, replicated state, tied aliases."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from zero_core.checkpoint.collective import gather_json


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Every extra name of a tied parameter -> its first name (the one the engine and the checkpoint use)."""
    first_name, aliases = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Buffers registered with ``persistent=False``: like ``state_dict()``, checkpoints leave them out."""
    names = set()
    for prefix, sub in module.named_modules():
        for buffer in getattr(sub, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{buffer}" if prefix else buffer)
    return names


def persistent_replicated_layout(engine) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (whole shape, dtype) of the engine's replicated state (buffers, parameters outside the optimizer)
    that a checkpoint keeps (not non-persistent buffers), in the order :func:`iter_persistent_replicated` yields
    them. No collective: nothing is gathered."""
    skip = non_persistent_buffers(engine.module)
    return {name: layout for name, layout in engine.replicated_layout().items() if name not in skip}


def iter_persistent_replicated(engine, buffers_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """That state one item at a time, whole: in stage 3 frozen parameters are gathered one unit at a time (a
    collective: every rank walks it to the end; copy what you keep before the next item). ``buffers_only``: the
    persistent buffers alone (nothing gathered)."""
    skip = non_persistent_buffers(engine.module)
    items = engine.module.named_buffers() if buffers_only else engine.iter_replicated()
    yield from ((name, tensor) for name, tensor in items if name not in skip)


def trainable_shapes(engine) -> dict[str, list[int]]:
    """Name -> full shape of every parameter the engine shards, gathered from all ranks' fragments. A collective.

    Fragments are the only stage-independent description (stage 3 parameters are not whole on any rank).
    """
    local = {f.name: list(f.shape) for f in engine.fragments()}
    shapes: dict[str, list[int]] = {}
    for part in gather_json(engine, local):
        shapes.update(part)
    return shapes
