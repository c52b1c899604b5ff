"""One rank of the restart soak (benchmarks/soak.py), launched by ``torchrun --max-restarts 3``.

Usage: soak_worker.py CHECKPOINTS OUT STEPS SAVE_EVERY KEEP KILLS, KILLS like "37,121,250" ("-": none). In
attempt i (TORCHELASTIC_RESTART_COUNT) rank i % 2 SIGKILLs itself after step KILLS[i]. Every attempt resumes from
zero_core.latest_checkpoint; after each save rank 0 removes all but the newest KEEP checkpoints. Rank 0 writes
the final weights, each attempt's resume point and the peak checkpoint-directory size to OUT.
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_core

CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2048}


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * step + rank))


def disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def prune(directory: Path, keep: int) -> None:
    """All but the newest ``keep`` complete checkpoints go; leftovers of interrupted saves are left to the next
    save of the same name (and skipped by latest_checkpoint)."""
    done = sorted((p for p in directory.iterdir() if zero_core.is_checkpoint(p) and not p.name.startswith(".")),
                  key=lambda p: int(p.name.split("-")[1]))
    for old in done[:-keep]:
        shutil.rmtree(old)


def main(checkpoints: Path, out: Path, steps: int, save_every: int, keep: int, kills: list) -> None:
    torch.set_num_threads(1)
    attempt = zero_core.restart_attempt()
    zero_core.init_process_group_for_attempt("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = out.with_suffix(".attempts.jsonl")
    with zero_core.setup(model, optimizer, CONFIG) as engine:
        start, latest = 0, zero_core.latest_checkpoint(checkpoints)
        if latest is not None:
            start = engine.load_checkpoint(latest)["step"]
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"attempt": attempt, "resumed_at": start}) + "\n")
        kill_at = kills[attempt] if attempt < len(kills) else None
        peak = 0
        for step in range(start, steps):
            model(batch(step, rank)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % save_every == 0:
                engine.save_checkpoint(checkpoints / f"step-{step + 1}", {"step": step + 1})
                if rank == 0:
                    prune(checkpoints, keep)
                    peak = max(peak, disk_bytes(checkpoints))
                dist.barrier()
            if kill_at is not None and step == kill_at and rank == attempt % 2:
                os.kill(os.getpid(), signal.SIGKILL)
        weights = {name: p.detach().clone() for name, p in engine.iter_full_params()}
    if rank == 0:
        torch.save({"weights": weights, "attempt": attempt, "peak_bytes": peak}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    kills = [] if sys.argv[6] == "-" else [int(v) for v in sys.argv[6].split(",")]
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), kills)
