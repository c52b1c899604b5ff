"""SGD with momentum, left to torch's choice of kernel, where a parameter gets its first gradient after the others
already have momentum buffers (a branch used from the second step on). The engine steps torch's fused kernel
where the user left the choice to torch, and torch's fused SGD fails on such a group (a TypeError: it takes every
momentum buffer or none); the engine steps the default implementation for that group then. Two ranks on the same
data at stages 1-3, with and without offload, against one process training the same model with torch's SGD."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from distributed import run_distributed

STEPS = 4


class LateBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.late = nn.Linear(8, 8)  # used from step 1 on

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.first(x)
        return (self.late(y) if step >= 1 else y).square().mean()


def _data(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # fused / foreach left to torch


def _reference() -> dict:
    model = LateBranch()
    optimizer = _sgd(model)
    for step in range(STEPS):
        model(_data(step), step).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    configs = {"stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
               "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    for name, config in configs.items():
        model = LateBranch()
        engine = zero_core.setup(model, _sgd(model), config)
        for step in range(STEPS):
            engine.backward(engine.module(_data(step), step))
            engine.step()
        out[name] = engine.full_state_dict(rank0_only=False)
    return out


@pytest.mark.timeout(180)
def test_sgd_momentum_with_a_parameter_that_starts_late():
    reference = _reference()
    for result in run_distributed(_worker, 2, timeout=150):
        for name, weights in result.items():
            for key, value in reference.items():
                assert torch.allclose(weights[key], value, atol=1e-6), (name, key)
