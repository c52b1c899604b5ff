"""Stage 3's backward hooks, bound to one runtime.

``PreBackward`` (a tiny autograd Function, as in FSDP2) wraps a module's outputs: its backward runs just before
the module's own backward, which is when the module's parameters must be gathered again. The release after the
module's backward is a multi-grad hook on the module's inputs (``after_input_grads``): it fires once their
gradients are computed. It adds no node to the graph: an identity node on the inputs would make autograd sum
the module's own contributions to an input's gradient first and the other consumers' after, a different
floating-point order than without ZeRO (e.g. an RMSNorm input that is also the residual); with the hook, the
gradients are bit-identical to the model's own.
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


def after_input_grads(callback: Callable[[], None], tree: Any) -> int:
    """Call ``callback`` once the gradients of every tensor in ``tree`` that requires grad are computed (those
    this backward needs); returns how many tensors it waits for."""
    single = _single_tensor(tree)
    if single is not None:  # the common case (one input tensor): a plain tensor hook, same timing, less work
        if not single.requires_grad:
            return 0
        single.register_hook(lambda grad: callback())
        return 1
    leaves, _ = tree_flatten(tree)
    tensors = [leaf for leaf in leaves if torch.is_tensor(leaf) and leaf.requires_grad]
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: callback(), mode="all")
    return len(tensors)


def _single_tensor(tree: Any):
    """The tensor when ``tree`` is a tensor, or ((tensor,), {}) as hooks see a one-argument call; else None."""
    if torch.is_tensor(tree):
        return tree
    if (isinstance(tree, tuple) and len(tree) == 2 and isinstance(tree[0], tuple) and len(tree[0]) == 1
            and not tree[1] and torch.is_tensor(tree[0][0])):
        return tree[0][0]
    return None


def attach(function: type[torch.autograd.Function], callback: Callable[[], None], tree: Any) -> tuple[Any, int]:
    """Route every tensor in ``tree`` that requires grad through ``function``; returns the tree and a count."""
    if torch.is_tensor(tree):  # one output tensor: no flattening
        return (function.apply(callback, tree)[0], 1) if tree.requires_grad else (tree, 0)
    leaves, spec = tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
    if not positions:
        return tree, 0
    outputs = function.apply(callback, *[leaves[i] for i in positions])
    for i, out in zip(positions, outputs):
        leaves[i] = out
    return tree_unflatten(leaves, spec), len(positions)
