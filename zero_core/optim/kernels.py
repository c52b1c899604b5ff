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


@contextlib.contextmanager
def only_params(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    """For the duration, each group lists only its members among ``params`` (the tile being stepped), so one
    step over a tile walks the tile's pieces and not every piece of the optimizer; the lists come back after."""
    wanted = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    for group, members in zip(optimizer.param_groups, saved):
        group["params"] = [p for p in members if id(p) in wanted]
    try:
        yield
    finally:
        for group, members in zip(optimizer.param_groups, saved):
            group["params"] = members
