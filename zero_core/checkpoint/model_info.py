"""What the model holds, as a checkpoint sees it: trainable parameters, replicated state, tied aliases."""

from __future__ import annotations

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


def persistent_replicated_state(engine) -> dict:
    """The engine's replicated state (buffers, parameters outside the optimizer), minus non-persistent buffers."""
    skip = non_persistent_buffers(engine.module)
    return {name: tensor for name, tensor in engine.replicated_state().items() if name not in skip}


def trainable_shapes(engine) -> dict[str, list[int]]:
    """Name -> full shape of every parameter the engine shards, gathered from all ranks' fragments. A collective.

    Fragments are the only stage-independent description (stage 3 parameters are not whole on any rank).
    """
    local = {f.name: list(f.shape) for f in engine.fragments()}
    shapes: dict[str, list[int]] = {}
    for part in gather_json(engine, local):
        shapes.update(part)
    return shapes
