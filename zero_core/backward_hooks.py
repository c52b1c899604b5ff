"""Stage 3's backward hooks: two tiny autograd Functions bound to one runtime, as FSDP2 does.

``PreBackward`` wraps a module's outputs: its backward runs just before the module's own backward, which is
when the module's parameters must be gathered again. ``PostBackward`` wraps the module's inputs: its backward
runs once the module's backward has produced the input gradients, when its parameters can be released.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


PostBackward = PreBackward  # the same identity function; only where it is attached differs


def attach(function: type[torch.autograd.Function], callback: Callable[[], None], tree: Any) -> tuple[Any, int]:
    """Route every tensor in ``tree`` that requires grad through ``function``; returns the tree and a count."""
    leaves, spec = tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
    if not positions:
        return tree, 0
    outputs = function.apply(callback, *[leaves[i] for i in positions])
    for i, out in zip(positions, outputs):
        leaves[i] = out
    return tree_unflatten(leaves, spec), len(positions)
