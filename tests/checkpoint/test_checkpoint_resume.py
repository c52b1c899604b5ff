"""Exact resume at world size 2 for every implemented stage, and plain (DDP) state dicts into ZeRO and back.

One spawn runs every case. A resumed run starts from a model built with another seed, so anything the load
missed (a fragment, optimizer state, a frozen layer, the LR schedule, the loss scale) shows in the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from distributed import run_distributed
from checkpoint_runs import TOLERANCE, DDPRun, ZeroRun, identical, max_difference, stages

FP16 = {"enabled": True, "auto_cast": True, "initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 1}


def resume_cases() -> list[tuple[str, dict]]:
    cases = [(model, {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 200})
             for stage in stages() for model in ("transformer", "mlp")]
    cases.append(("mlp", {"stage": 2, "fp16": FP16}))  # loss-scaler state and skipped steps
    cases.append(("transformer", {"stage": 1, "bf16": {"enabled": True}}))  # 16-bit params, fp32 masters
    return cases


def resume_case(directory: Path, model: str, config: dict) -> dict:
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    first = ZeroRun(model, config)
    first.train(3)
    save_checkpoint(first.engine, directory, first.client_state())
    expected = first.train(3)
    resumed = ZeroRun(model, config, seed=1)
    resumed.restore(load_checkpoint(resumed.engine, directory))
    losses = resumed.train(3)
    scaler, other = first.engine.loss_scaler, resumed.engine.loss_scaler
    return {
        "identical": identical(first.params(), resumed.params()),
        "losses": (expected, losses),
        "lrs": ([g["lr"] for g in first.engine.optimizer.param_groups],
                [g["lr"] for g in resumed.engine.optimizer.param_groups]),
        "scaler": (scaler.state_dict() if scaler else None, other.state_dict() if other else None),
        "skipped": (first.engine.skipped_steps, resumed.engine.skipped_steps),
    }


def ddp_round_trip(directory: Path) -> dict:
    """DDP state dicts -> ZeRO (continue, compare), then ZeRO -> consolidated files -> DDP (continue, compare)."""
    from zero_core.checkpoint import consolidate, export_optimizer_state, load_full_state_dict, save_checkpoint

    prefix = str(directory / "ddp")
    ddp = DDPRun("transformer")
    ddp.train(3)
    if dist.get_rank() == 0:
        ddp.save(prefix)
    dist.barrier()
    zero = ZeroRun("transformer", {"stage": 2}, seed=1)
    load_full_state_dict(zero.engine, f"{prefix}-model.pt", f"{prefix}-optimizer.pt")
    zero.restore(torch.load(f"{prefix}-client.pt", weights_only=True))
    zero.train(3), ddp.train(3)
    into_zero = max_difference(zero.params(), ddp.params())

    save_checkpoint(zero.engine, directory / "zero", zero.client_state())
    if dist.get_rank() == 0:
        consolidate(directory / "zero", directory / "full", progress=False)
        export_optimizer_state(directory / "zero", directory / "optimizer.pt")
    dist.barrier()
    back = DDPRun("transformer", seed=1)
    index = json.loads((directory / "full" / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(directory / "full" / file))
    missing, unexpected = back.module.load_state_dict(state, strict=False)
    back.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
    back.scheduler.load_state_dict(zero.client_state()["scheduler"])
    back.step = zero.step
    back.train(3), zero.train(3)
    return {"into_zero": into_zero, "back_to_ddp": max_difference(zero.params(), back.params()),
            "missing": missing, "unexpected": unexpected, "tied": index["metadata"]["tied_weights"]}


def resume_worker(rank: int, world_size: int, directory: str, cases: list) -> dict:
    results = []
    for index, (model, config) in enumerate(cases):
        try:
            results.append(resume_case(Path(directory) / f"case{index}", model, config))
        except Exception as error:
            error.add_note(f"in case {model} {config}")
            raise
    return {"resume": results, "ddp": ddp_round_trip(Path(directory))}


@pytest.mark.timeout(300)
def test_resume_is_exact_and_plain_state_dicts_round_trip(tmp_path):
    cases = resume_cases()
    per_rank = run_distributed(resume_worker, 2, str(tmp_path), cases, timeout=240)
    problems = []
    for rank, result in enumerate(per_rank):
        for (model, config), r in zip(cases, result["resume"], strict=True):
            where = f"rank {rank}, {model} {config}"
            for key in ("losses", "lrs", "scaler", "skipped"):
                if r[key][0] != r[key][1]:
                    problems.append(f"{where}: {key} after resume {r[key][1]} != uninterrupted {r[key][0]}")
            if not r["identical"]:
                problems.append(f"{where}: weights after resume differ from the uninterrupted run")
        ddp = result["ddp"]
        if not ddp["into_zero"] <= TOLERANCE or not ddp["back_to_ddp"] <= TOLERANCE:
            problems.append(f"rank {rank}: DDP->ZeRO differs by {ddp['into_zero']:.3g}, "
                            f"ZeRO->DDP by {ddp['back_to_ddp']:.3g} (> {TOLERANCE})")
        if ddp["missing"] != ["head.weight"] or ddp["unexpected"] or ddp["tied"] != {"head.weight": "tok.weight"}:
            problems.append(f"rank {rank}: consolidated model keys: missing {ddp['missing']}, unexpected "
                            f"{ddp['unexpected']}, tied {ddp['tied']} (only the tied head should be absent)")
    fp16 = per_rank[0]["resume"][len(cases) - 2]
    if fp16["skipped"][0] == 0 and fp16["scaler"][0]["scale"] == 2.0**12:
        problems.append(f"the fp16 case exercised neither skipped steps nor scale changes: {fp16}")
    assert not problems, "\n".join(problems)
