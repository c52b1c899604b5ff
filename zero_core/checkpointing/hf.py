"""Hugging Face's own activation checkpointing (``model.gradient_checkpointing_enable()``) through the engine.

Transformers stores, on each module that checkpoints its layers, the function it calls
(``module._gradient_checkpointing_func``: torch.utils.checkpoint with the user's keywords). At stage 3 that
function works unchanged (the stage 3 hooks see the recomputation as part of backward); for the
``activation_checkpointing`` block to apply too (cpu_checkpointing, ...), ``zero_core.setup`` points those
modules at ``zero_core.checkpointing.checkpoint``, with the same keywords, when the block asks for anything.
"""

from __future__ import annotations

import functools

from torch import nn

from zero_core.checkpointing.function import checkpoint


def route_hf_checkpointing(model: nn.Module) -> int:
    """Make the modules of ``model`` with Hugging Face gradient checkpointing on call ``checkpoint``; returns how
    many. Call it after ``gradient_checkpointing_enable()`` when that came after ``zero_core.setup``."""
    routed = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if not getattr(module, "gradient_checkpointing", False) or func is None:
            continue
        keywords = dict(func.keywords) if isinstance(func, functools.partial) else {}
        module._gradient_checkpointing_func = functools.partial(checkpoint, **keywords)
        routed += 1
    return routed
