"""Which of torch's optimizer kernels the step runs: one multi-tensor call over all the pieces, not one per piece.

The optimizer steps one fp32 piece per parameter fragment (master_shards.py). torch's default implementation on
CPU tensors is a Python loop with several kernels per tensor, which makes a model of many small parameters pay
per piece; on CUDA it is the ``foreach`` one, which passes over the optimizer state several times (AdamW: about
three times the fused kernel's time on an H200, docs/benchmarks.md). Where the user left the choice to torch
(``fused`` and ``foreach`` both None) and torch has a fused kernel for the optimizer (Adam, AdamW, SGD, Adagrad,
on CPU and CUDA), the step runs it, as DeepSpeed steps its own fused Adam; the group dicts are restored
afterwards, so ``state_dict()`` and the user's settings are unchanged. The fused kernel does the same
arithmetic, elementwise, so only rounding can differ from the loop.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# torch optimizers with a fused kernel on CPU tensors (torch.optim.*(fused=True)), and those with one on CUDA
# in every torch this project supports.
FUSED_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
FUSED_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def fused_sgd_would_fail(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """torch's fused SGD with momentum takes the momentum buffers of all of a group's parameters or of none: a
    parameter stepped for the first time (no buffer yet) beside others that have one makes it raise a TypeError
    (torch 2.13), where its other implementations take them one by one. A parameter that got no gradient in the
    first steps (an unused expert, a frozen-then-unfrozen layer) leaves its group in that state."""
    if not isinstance(optimizer, torch.optim.SGD) or not group.get("momentum"):
        return False
    state = optimizer.state
    having = {state[p].get("momentum_buffer") is not None if p in state else False for p in group["params"]}
    return len(having) > 1


def _left_to_torch(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    params = group["params"]
    if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable") or not params:
        return False
    device = params[0].device.type
    if fused_sgd_would_fail(optimizer, group):
        return False
    return isinstance(optimizer, FUSED_CPU if device == "cpu" else FUSED_CUDA if device == "cuda" else ())


def _steps_on_param_devices(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """The fused CUDA kernels take each parameter's ``step`` count on the parameter's device; torch keeps it on
    the CPU for the other implementations (a state created or loaded while the group was not fused)."""
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if isinstance(step, torch.Tensor) and step.device != param.device:
            optimizer.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


@contextlib.contextmanager
def multi_tensor_kernels(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """For the duration, groups of masters whose implementation the user did not choose step fused."""
    chosen = []
    if "fused" in optimizer.defaults:
        chosen = [group for group in optimizer.param_groups if _left_to_torch(optimizer, group)]
    for group in chosen:
        group["fused"] = True
        if group["params"][0].device.type != "cpu":
            _steps_on_param_devices(optimizer, group)
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
