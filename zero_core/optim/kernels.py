"""Which of torch's optimizer kernels the step runs: one multi-tensor call over all the pieces, not one per piece.

The optimizer steps one fp32 piece per parameter fragment (master_shards.py). torch's default implementation on
CPU tensors is a Python loop with several kernels per tensor (on CUDA it is already the ``foreach`` one), which
makes a model of many small parameters pay per piece. Where the user left the choice to torch (``fused`` and
``foreach`` both None) and torch has a fused kernel for the optimizer on CPU (Adam, AdamW, SGD, Adagrad), the
step runs it; the group dicts are restored afterwards, so ``state_dict()`` and the user's settings are unchanged.
The fused kernel does the same arithmetic, elementwise, so only rounding can differ from the loop.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# torch optimizers with a fused CPU kernel (torch.optim.*(fused=True) on CPU tensors).
FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _left_to_torch(group: dict) -> bool:
    params = group["params"]
    return (group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable")
            and bool(params) and params[0].device.type == "cpu")


@contextlib.contextmanager
def multi_tensor_kernels(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For the duration, groups of CPU masters whose implementation the user did not choose step fused."""
    chosen = []
    if isinstance(optimizer, FUSED_CPU) and "fused" in optimizer.defaults:
        chosen = [group for group in optimizer.param_groups if _left_to_torch(group)]
    for group in chosen:
        group["fused"] = True
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None
