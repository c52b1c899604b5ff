"""The model, data, optimizer and schedule shared by the DeepSpeed fixtures and the take-over tests.

tests/checkpoint/fixtures/deepspeed/make_fixtures.py trains it under the real DeepSpeed (in its own venv, with this
folder on PYTHONPATH); tests/checkpoint/test_takeover_deepspeed.py continues the same run on our engine and checks it
against one plain process. Only torch is imported here, so both sides can use it.

Each step's batch is global (GLOBAL_BATCH rows, seeded by the step) and a rank of ``world`` takes its
contiguous slice, so the averaged gradient at 1, 2 or 3 ranks is the gradient of the whole batch.
"""

from __future__ import annotations

import torch
from torch import nn

SIZES = (19, 47, 31, 7)  # odd, so DeepSpeed's partitions and ours never line up with parameter boundaries
GLOBAL_BATCH = 6  # divides by 1, 2 and 3
LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.99), 0.05
STEPS_BEFORE, STEPS_AFTER = 4, 4


class TakeoverMLP(nn.Module):
    """19 -> 47 -> LayerNorm -> 31 -> 7, with biases and a float buffer (2,746 parameters)."""

    def __init__(self, seed: int = 0, frozen: bool = False):
        super().__init__()
        n_in, n_hidden, n_mid, n_out = SIZES
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(n_in, n_hidden)
            self.norm = nn.LayerNorm(n_hidden)
            self.mid = nn.Linear(n_hidden, n_mid)
            self.out = nn.Linear(n_mid, n_out)
        self.register_buffer("input_scale", torch.linspace(0.5, 1.5, n_in))
        if frozen:  # a frozen middle layer: DeepSpeed keeps it outside the optimizer (frozen_param_fragments)
            self.mid.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.inp.weight.dtype) * self.input_scale.to(self.inp.weight.dtype)
        return self.out(torch.tanh(self.mid(torch.tanh(self.norm(self.inp(x))))))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, SIZES[0], generator=generator)
    y = torch.randn(GLOBAL_BATCH, SIZES[-1], generator=generator)
    return x, y


def rank_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    if GLOBAL_BATCH % world:
        raise ValueError(f"a global batch of {GLOBAL_BATCH} does not split over {world} ranks")
    x, y = global_batch(step)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def param_groups(model: nn.Module, one_group: bool = False) -> list[dict]:
    """Weight decay on matrices only: two groups, so group order and hyper-parameters are carried over."""
    params = [p for p in model.parameters() if p.requires_grad]
    if one_group:
        return [{"params": params, "weight_decay": WEIGHT_DECAY}]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, one_group: bool = False) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, one_group), lr=LR, betas=BETAS)


def lr_factor(step: int) -> float:
    return 1.0 / (1.0 + 0.25 * step)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def reference_params(steps: int, one_group: bool = False, frozen: bool = False) -> dict[str, torch.Tensor]:
    """One plain process: AdamW over the whole batch of every step, from step 0."""
    model = TakeoverMLP(frozen=frozen)
    optimizer = make_optimizer(model, one_group)
    scheduler = make_scheduler(optimizer)
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, global_batch(step)).backward()
        optimizer.step()
        scheduler.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
