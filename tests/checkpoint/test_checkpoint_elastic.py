"""Resharding: save at world size 4 (stage 3 when it exists, else 2), load at world size 2 and 1 under every
stage, continue, and match the reference, DDP resumed from its own plain state dicts at the same world size.

Also loads the DDP state dicts (saved at world size 4) straight into ZeRO at the new world sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from distributed import run_distributed
from checkpoint_runs import TOLERANCE, DDPRun, ZeroRun, max_difference, stages

MODELS = ("transformer", "mlp")
SMALL_BUCKETS = {"reduce_bucket_size": 150, "allgather_bucket_size": 150}


def save_worker(rank: int, world_size: int, directory: str, stage: int) -> dict:
    from zero_core.checkpoint import save_checkpoint

    differences = {}
    for model in MODELS:
        ddp = DDPRun(model)
        ddp.train(3)
        if rank == 0:
            ddp.save(f"{directory}/{model}-ddp")
        zero = ZeroRun(model, {"stage": stage, **SMALL_BUCKETS})
        zero.train(3)
        save_checkpoint(zero.engine, Path(directory, f"{model}-zero"), zero.client_state())
        differences[model] = max_difference(zero.params(), ddp.params())
    dist.barrier()
    return differences


def continue_worker(rank: int, world_size: int, directory: str, load_stages: list) -> dict:
    from zero_core.checkpoint import load_checkpoint, load_full_state_dict

    results = {}
    for model in MODELS:
        prefix = f"{directory}/{model}-ddp"
        reference = DDPRun(model, seed=1)
        reference.load(prefix)
        reference.train(3)
        for stage in load_stages:
            zero = ZeroRun(model, {"stage": stage, **SMALL_BUCKETS}, seed=1)
            zero.restore(load_checkpoint(zero.engine, Path(directory, f"{model}-zero")))
            zero.train(3)
            results[f"{model}, sharded checkpoint -> stage {stage}"] = max_difference(zero.params(), reference.params())
            plain = ZeroRun(model, {"stage": stage}, seed=1)
            load_full_state_dict(plain.engine, f"{prefix}-model.pt", f"{prefix}-optimizer.pt")
            plain.restore(DDPRun.client(prefix))
            plain.train(3)
            results[f"{model}, DDP state dicts -> stage {stage}"] = max_difference(plain.params(), reference.params())
    return results


@pytest.mark.timeout(300)
def test_save_at_four_ranks_load_at_two_and_one(tmp_path):
    available = stages()
    saved_at_four = run_distributed(save_worker, 4, str(tmp_path), max(available), timeout=150)
    problems = [f"world size 4: ZeRO differs from DDP by {d:.3g} for {model} before saving"
                for per_rank in saved_at_four for model, d in per_rank.items() if not d <= TOLERANCE]
    for world_size in (2, 1):
        per_rank = run_distributed(continue_worker, world_size, str(tmp_path), available, timeout=150)
        problems += [f"world size {world_size}, rank {rank}: {case} differs from DDP by {d:.3g} (> {TOLERANCE})"
                     for rank, results in enumerate(per_rank) for case, d in results.items() if not d <= TOLERANCE]
    assert not problems, "\n".join(problems)
