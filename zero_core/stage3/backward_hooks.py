"""Stage 3's backward hooks, bound to one runtime.

The gather before a module's backward (``attach``) fires when the gradient of the module's output is complete,
just before the module's own backward, which is when its parameters must be gathered again. For the usual
output, one tensor computed in the module, that is a pre-hook on the tensor's autograd node: no node is added
and no Python function runs in backward but the hook (several times cheaper per module than a custom Function).
Several output tensors get a pre-hook on each of their nodes, the first to run calling back once. An output that
is a leaf goes through ``PreBackward``, a tiny autograd Function (as in FSDP2) whose backward runs once every
output's gradient is in. Node pre-hooks run after tensor hooks on the same node,
so the previous module's release (below, a tensor hook on this module's output) still comes first. The release after the
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
    """Call ``callback`` before the backward of what produced ``tree``: a pre-hook on the autograd node of its one
    tensor that requires grad, or else every such tensor routed through ``function``. Returns the tree (new
    tensors where routed) and how many tensors take part."""
    if torch.is_tensor(tree):  # one output tensor: no flattening
        if not tree.requires_grad:
            return tree, 0
        node = tree.grad_fn
        if node is None:  # a leaf: its hooks would outlive this forward
            return function.apply(callback, tree)[0], 1
        node.register_prehook(lambda grads: callback())
        return tree, 1
    leaves, spec = tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
    if not positions:
        return tree, 0
    if len(positions) == 1 and leaves[positions[0]].grad_fn is not None:
        leaves[positions[0]].grad_fn.register_prehook(lambda grads: callback())
        return tree, 1
    nodes = {leaves[i].grad_fn for i in positions}
    if None not in nodes:
        # Several outputs computed here (a model's loss and logits): a pre-hook on each node, the first that runs
        # calls back, as FSDP2 hooks each output. Routing them through ``function`` would make them views of one
        # call, which autograd forbids modifying in place (Hugging Face's Trainer scales the returned loss in place).
        pending = [True]

        def first(grads):
            if pending[0]:
                pending[0] = False
                callback()

        for node in nodes:
            node.register_prehook(first)
        return tree, len(positions)
    outputs = function.apply(callback, *[leaves[i] for i in positions])
    for i, out in zip(positions, outputs):
        leaves[i] = out
    return tree_unflatten(leaves, spec), len(positions)
