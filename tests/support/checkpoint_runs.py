"""Helpers shared by the checkpoint tests (no tests here): training that can stop and resume at any step,
on ZeRO or on DDP, and comparisons of the results.

Batches depend on (rank, step), so a run resumed at step k reads exactly the batches the uninterrupted run
read; a run at another world size reads the batches of its own ranks, like the reference at that size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models import build_model, make_batch
from reference import DDPDriver, EngineDriver, make_optimizer, make_scheduler, train_loop

# Float reordering only (the parity tests' bound): sums over ranks and buckets happen in another order.
TOLERANCE = 1e-5


def stages() -> list[int]:
    """Every ZeRO stage; checkpoints must work (and reshard) across all of them."""
    return [1, 2, 3]


def batches(model: str, start: int):
    rank = dist.get_rank()
    return lambda step, micro: make_batch(model, rank, start + step, micro)


class ZeroRun:
    """A model, optimizer, scheduler and engine that train for any number of steps from any step."""

    def __init__(self, model: str, config: dict, seed: int = 0):
        import zero_core

        self.model = model
        module = build_model(model, seed)
        optimizer = make_optimizer(module)
        self.scheduler = make_scheduler(optimizer)
        self.engine = zero_core.setup(module, optimizer, config)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses, _ = train_loop(EngineDriver(self.engine), self.scheduler, batches(self.model, self.step), steps)
        self.step += steps
        return losses

    def client_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "step": self.step}

    def restore(self, client_state: dict) -> None:
        self.scheduler.load_state_dict(client_state["scheduler"])
        self.step = client_state["step"]

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in self.engine.module.named_parameters()}


class DDPRun:
    """The reference: the same model, optimizer and scheduler under DistributedDataParallel."""

    def __init__(self, model: str, seed: int = 0):
        self.model = model
        self.module = build_model(model, seed)
        self.optimizer = make_optimizer(self.module)
        self.scheduler = make_scheduler(self.optimizer)
        self.driver = DDPDriver(self.module, self.optimizer)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses, _ = train_loop(self.driver, self.scheduler, batches(self.model, self.step), steps)
        self.step += steps
        return losses

    def save(self, prefix: str) -> None:
        """The plain state dicts a DDP user writes (the model's with DDP's ``module.`` prefix)."""
        torch.save(self.driver.ddp.state_dict(), f"{prefix}-model.pt")
        torch.save(self.optimizer.state_dict(), f"{prefix}-optimizer.pt")
        torch.save({"scheduler": self.scheduler.state_dict(), "step": self.step}, f"{prefix}-client.pt")

    def load(self, prefix: str) -> None:
        state = torch.load(f"{prefix}-model.pt", weights_only=True)
        self.driver.ddp.load_state_dict(state)
        self.optimizer.load_state_dict(torch.load(f"{prefix}-optimizer.pt", weights_only=True))
        client = self.client(prefix)
        self.scheduler.load_state_dict(client["scheduler"])
        self.step = client["step"]

    @staticmethod
    def client(prefix: str) -> dict:
        return torch.load(f"{prefix}-client.pt", weights_only=True)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max((a[n] - b[n]).abs().max().item() for n in a)


def identical(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
