"""A stuck (not dead) rank: rank 1 of 3 sleeps inside step 2, outside any collective, until told to stop. Ranks
0 and 2, waiting for it in stage 3's parameter gather, name it within seconds of the guard's stall limit (a
warning saying what its main thread is doing and what its last collective was) and raise an error once it has
issued no collective for ``ZERO_CORE_GUARD_STUCK_S`` seconds, instead of waiting for the process group's
timeout. A rank that is stopped (SIGSTOP: not even its heartbeat thread runs) is named too, by its frozen
heartbeat. The same steps without the sleep train to DDP's weights (the heartbeats change
nothing while every rank keeps up)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_core
from distributed import run_distributed

STALL_S, STUCK_S, STUCK_AT = 1.0, 4.0, 2
CONFIG = {"stage": 3, "param_persistence_threshold": 0}


def stuck_in_step(release: Path) -> None:
    while not release.exists():  # "forever", until the test's other ranks are done
        time.sleep(0.2)


def stopped_in_step(release: Path) -> None:
    """A process that works a while, then is stopped (SIGSTOP): alive, sockets open, but not even its heartbeat
    thread runs."""
    release.with_suffix(".pid").write_text(str(os.getpid()))
    time.sleep(1.5)  # heartbeats show this frame
    os.kill(os.getpid(), signal.SIGSTOP)


def train(rank: int, release: Path, stuck) -> dict:
    os.environ.update(ZERO_CORE_GUARD_STALL_S=str(STALL_S), ZERO_CORE_GUARD_STUCK_S=str(STUCK_S))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = zero_core.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), CONFIG)
    started = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(4):
                if step == STUCK_AT:
                    started = time.monotonic()
                    if stuck and rank == 1:
                        stuck(release)
                        return {"released": True}
                x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
                engine.backward(model(x).pow(2).mean())
                engine.step()
        except RuntimeError as error:
            release.touch()
            if release.with_suffix(".pid").exists():
                try:
                    os.kill(int(release.with_suffix(".pid").read_text()), signal.SIGCONT)
                except ProcessLookupError:
                    pass  # another waiting rank continued it first, and it has returned and exited
            return {"error": str(error), "seconds": time.monotonic() - started,
                    "named": [(str(w.message), time.monotonic()) for w in caught if "stuck or slow" in str(w.message)]}
    return {"weights": [p.detach().clone() for _, p in engine.iter_full_params()]}


def worker(rank: int, world_size: int, release: str, how: str) -> dict:
    return train(rank, Path(release), {"sleeps": stuck_in_step, "stopped": stopped_in_step}[how])


@pytest.mark.timeout(120)
def test_a_stuck_rank_is_named_by_every_other_rank_and_the_job_exits(tmp_path):
    results = run_distributed(worker, 3, str(tmp_path / "release"), "sleeps", timeout=90)
    assert results[1] == {"released": True}
    for rank in (0, 2):
        found = results[rank]
        assert "error" in found, (rank, found)
        message = found["error"]
        assert "rank 1 (pid " in message and "is stuck or slow" in message and "stuck_in_step" in message, message
        assert "time.sleep(0.2)" in message and "Its last collective:" in message, message
        assert "ZERO_CORE_GUARD_STUCK_S=4" in message, message
        # named once it waited STALL_S, an error at STUCK_S without a collective; well before the group's timeout
        assert STUCK_S - 1 <= found["seconds"] < STUCK_S + 6, found["seconds"]  # counted from its last collective
        assert found["named"], "no warning named the stuck rank before the error"


@pytest.mark.timeout(120)
def test_a_stopped_rank_whose_heartbeat_stops_is_named_too(tmp_path):
    """SIGSTOP: the stuck rank's own guard thread stops too, so its heartbeat freezes; the waiting ranks notice
    that it no longer changes."""
    results = run_distributed(worker, 3, str(tmp_path / "release"), "stopped", timeout=90)
    assert results[1] == {"released": True}
    pid = (tmp_path / "release.pid").read_text()
    for rank in (0, 2):
        message = results[rank].get("error") or ""
        assert f"rank 1 (pid {pid} on " in message and "heartbeat stopped" in message, (rank, results[rank])
        assert "stopped_in_step" in message and "ZERO_CORE_GUARD_STUCK_S=4" in message, message
        assert STUCK_S - 1 <= results[rank]["seconds"] < STUCK_S + 8, results[rank]["seconds"]


def reference(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def both(rank: int, world_size: int, release: str) -> tuple:
    return train(rank, Path(release), None)["weights"], reference(rank, world_size)


@pytest.mark.timeout(120)
def test_without_a_stuck_rank_the_heartbeats_change_nothing(tmp_path):
    for got, expected in run_distributed(both, 3, str(tmp_path / "release"), timeout=90):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
