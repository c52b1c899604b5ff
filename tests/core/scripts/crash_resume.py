"""A job that saves every SAVE_EVERY steps and resumes by itself from zero_core.latest_checkpoint; for
tests/reliability/test_torchrun_restarts.py, launched by ``torchrun --max-restarts 1``.

Usage: python crash_resume.py CHECKPOINT_DIR OUT_FILE KILL_AT_STEP (-1: never). On the first attempt
(TORCHELASTIC_RESTART_COUNT=0) rank 1 SIGKILLs itself after step KILL_AT_STEP; torchrun restarts both ranks,
which find the newest complete checkpoint and go on. Rank 0 writes the final weights and where it resumed from.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_core

STEPS = 8
SAVE_EVERY = 2
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + rank))


def init_for_attempt(attempt: int) -> None:
    """gloo over torchrun's store, under a key prefix of its own per attempt: with the plain env:// init
    (torch 2.13), a restarted rank reads the addresses the killed attempt left in the store and fails to
    connect ("Gloo connectFullMesh failed ... Connection refused")."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          use_libuv=True)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
                            world_size=world)


def main(checkpoints: Path, out: Path, kill_at: int) -> None:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_for_attempt(attempt)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with zero_core.setup(model, optimizer, CONFIG) as engine:
        start, resumed_from = 0, None
        latest = zero_core.latest_checkpoint(checkpoints)
        if latest is not None:
            start = engine.load_checkpoint(latest)["step"]
            resumed_from = latest.name
        for step in range(start, STEPS):
            model(batch(rank, step)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % SAVE_EVERY == 0:
                engine.save_checkpoint(checkpoints / f"step-{step + 1}", {"step": step + 1})
            if attempt == 0 and rank == 1 and step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exception, no cleanup
        weights = {name: p.detach().clone() for name, p in engine.iter_full_params()}
    if rank == 0:
        torch.save({"weights": weights, "resumed_from": resumed_from, "attempt": attempt}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
