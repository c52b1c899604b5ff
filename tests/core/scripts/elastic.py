"""An elastic job for tests/reliability/test_elastic.py: ``torchrun --nnodes 1:2 --nproc-per-node 1`` with a c10d
rendezvous, one torchrun agent per simulated node. It keeps GLOBAL samples per optimizer step at any world size by
changing gradient accumulation (zero_core.accumulation_for), resumes from zero_core.latest_checkpoint at every
start (checkpoints reshard on load), and draws each sample from (step, sample index), so the run equals a
fixed-size one whatever sizes it ran at.

Usage: python elastic.py CHECKPOINT_DIR OUT_PREFIX. Rank 0 appends (attempt, world size, accumulation, resumed
step) to OUT_PREFIX.jsonl at each start and writes the final weights to OUT_PREFIX.pt.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_core

STEPS, GLOBAL, MICRO, SAVE_EVERY = 60, 8, 2, 2
STEP_S = 0.3  # room for the test to remove and add a node mid-run
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


def sample(step: int, index: int) -> torch.Tensor:
    return torch.randn(10, generator=torch.Generator().manual_seed(1000 * step + index))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def main(checkpoints: Path, out: Path) -> None:
    torch.set_num_threads(1)
    zero_core.init_process_group_for_attempt("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accumulation = zero_core.accumulation_for(GLOBAL, MICRO)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with zero_core.setup(model, optimizer, CONFIG) as engine:
        start, latest = 0, zero_core.latest_checkpoint(checkpoints)
        if latest is not None:
            start = engine.load_checkpoint(latest)["step"]
        if rank == 0:
            with out.with_suffix(".jsonl").open("a") as f:
                f.write(json.dumps({"attempt": zero_core.restart_attempt(), "world": world,
                                    "accumulation": accumulation, "resumed_at": start}) + "\n")
        for step in range(start, STEPS):
            time.sleep(STEP_S)
            for micro in range(accumulation):
                first = (rank * accumulation + micro) * MICRO  # this micro-batch's samples of the global batch
                x = torch.stack([sample(step, first + i) for i in range(MICRO)])
                loss = model(x).pow(2).mean() / accumulation
                if micro < accumulation - 1:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % SAVE_EVERY == 0:
                engine.save_checkpoint(checkpoints / f"step-{step + 1}", {"step": step + 1})
        weights = {name: p.detach().clone() for name, p in engine.iter_full_params()}
    if rank == 0:
        torch.save(weights, out.with_suffix(".pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
