"""The DDP reference, and the one training loop that drives both DDP and the ZeRO engine.

Both sides build the same model (same seed), the same AdamW with two parameter groups, the same LR
scheduler (created on the user's optimizer before any wrapping) and read the same batches, so a
difference in the results can only come from the engine. Call these inside an initialized group.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

LR = 3e-3
WEIGHT_DECAY = 0.1


def make_optimizer(model: torch.nn.Module, lr: float = LR) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases, norms and 1-D weights get none)."""
    return torch.optim.AdamW(decay_groups(model), lr=lr)


def make_sgd(model: torch.nn.Module, lr: float = LR) -> torch.optim.SGD:
    """SGD with momentum: unlike Adam, its updates scale with the gradient, so a wrong average shows."""
    return torch.optim.SGD(decay_groups(model), lr=lr, momentum=0.9)


def decay_groups(model: torch.nn.Module) -> list[dict]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]


def lr_factor(step: int) -> float:
    # Warm up for 3 steps, then decay: the LR differs at every step, so a scheduler that stopped
    # reaching the optimizer would show in the weights.
    return min(1.0, (step + 1) / 3) * 0.9 ** max(0, step - 2)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


@dataclass
class Result:
    params: dict[str, torch.Tensor]  # name -> fp32 copy of the final weights (tied weights once)
    losses: list[float]  # per step: this rank's loss, summed over micro-batches
    norms: list[float]  # per step: the gradient norm before clipping (empty when not clipping)
    lrs: list[float]  # per parameter group, after the run


class DDPDriver:
    def __init__(self, model, optimizer):
        self.ddp = DistributedDataParallel(model)
        self.optimizer = optimizer

    def forward(self, batch):
        return self.ddp(*batch)

    def backward(self, loss):
        loss.backward()

    def no_sync(self):
        return self.ddp.no_sync()

    def clip(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), max_norm)

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()


class EngineDriver:
    """The same calls on a `zero_core` engine; its step() also zeroes the gradients."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, batch):
        return self.engine.module(*batch)

    def backward(self, loss):
        self.engine.backward(loss)

    def no_sync(self):
        return self.engine.no_sync()

    def clip(self, max_norm):
        return self.engine.clip_grad_norm_(max_norm)

    def step(self):
        self.engine.step()
        if not self.engine.step_zeroes_grads:
            self.engine.zero_grad()  # whole averaged gradients stay after step(), as with a torch optimizer


def train_loop(driver, scheduler, batches, steps, accumulation=1, clip=None, no_sync=True):
    """Run `steps` optimizer steps; `batches(step, micro)` gives this rank's batch.

    With `no_sync`, every micro-batch but the last of a step runs under `driver.no_sync()`.
    Returns (losses, norms) as described on `Result`.
    """
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            skip_sync = no_sync and micro < accumulation - 1
            with driver.no_sync() if skip_sync else nullcontext():
                loss = driver.forward(batches(step, micro)) / accumulation
                driver.backward(loss)
            total += loss.item()
        if clip is not None:
            norms.append(float(driver.clip(clip)))
        driver.step()
        scheduler.step()
        losses.append(total)
    return losses, norms


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _rank_batches(data_fn):
    rank = dist.get_rank()
    return lambda step, micro: data_fn(rank, step, micro)


def train_ddp(model_fn, data_fn, steps, accumulation=1, clip=None, no_sync=True, lr=LR,
              optimizer_fn=make_optimizer) -> Result:
    """Train `model_fn()` under DistributedDataParallel on `data_fn(rank, step, micro)`."""
    model = model_fn()
    optimizer = optimizer_fn(model, lr)
    scheduler = make_scheduler(optimizer)
    driver = DDPDriver(model, optimizer)
    losses, norms = train_loop(driver, scheduler, _rank_batches(data_fn), steps, accumulation, clip, no_sync)
    lrs = [group["lr"] for group in optimizer.param_groups]
    return Result(snapshot(model), losses, norms, lrs)


def train_zero(model_fn, data_fn, config, steps, accumulation=1, clip=None, no_sync=True, lr=LR,
               optimizer_fn=make_optimizer, scheduler_after_setup=False):
    """The same run through `zero_core.setup`; returns (Result, engine, the user's optimizer).

    `clip` calls `engine.clip_grad_norm_`; leave it None to test `gradient_clipping` in `config`.
    The scheduler is built on the user's optimizer before setup, or on `engine.optimizer` after.
    """
    import zero_core  # imported here so the DDP reference runs without the engine

    model = model_fn()
    optimizer = optimizer_fn(model, lr)
    if not scheduler_after_setup:
        scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    if scheduler_after_setup:
        scheduler = make_scheduler(engine.optimizer)
    driver = EngineDriver(engine)
    losses, norms = train_loop(driver, scheduler, _rank_batches(data_fn), steps, accumulation, clip, no_sync)
    lrs = [group["lr"] for group in engine.optimizer.param_groups]
    return Result(snapshot(model), losses, norms, lrs), engine, optimizer
