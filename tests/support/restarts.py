"""What the front-end restart tests share: a launcher run with a deadline, and the uninterrupted run's weights.

The scripts (tests/*/scripts/crash_resume*.py) train the same model on batches drawn from (step, rank), so the
uninterrupted run is the plain PyTorch loop below: a world-size-2 ZeRO step is DDP's, the mean of both ranks'
losses. It runs here in the test process, in milliseconds, instead of as a second launched job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import launch as launching


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + rank))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def uninterrupted_weights(steps: int, world_size: int = 2, lr: float = 1e-2, weight_decay: float = 1e-2,
                          data=batch) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` AdamW steps of DDP at ``world_size`` on ``data(step, rank)``."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        loss = sum(model(data(step, rank)).pow(2).mean() for rank in range(world_size)) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def launch(command: list[str], timeout: float, cwd: Path) -> str:
    """Run a launcher (torchrun, accelerate launch) in its own session (``launch.run``); on timeout or failure kill
    the whole session and fail with the output's tail. The environment carries this checkout on PYTHONPATH."""
    return launching.run(command, timeout=timeout, cwd=cwd)


def torchrun(script: Path, *args: str, port: int, restarts: int = 1, nproc: int = 2,
             swap: bool = False) -> list[str]:
    """``swap``: run the script under ``-m accelerate_zero.swap`` (ZeroAccelerator for an HF Trainer script)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "--monitor-interval", "0.5", "--master-addr", "127.0.0.1",
            "--master-port", str(port), *(["-m", "accelerate_zero.swap"] if swap else []), str(script), *args]


def assert_weights_equal(got: dict, expected: dict, atol: float = 1e-6) -> None:
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(got[name].float(), value, rtol=0, atol=atol, msg=name)
