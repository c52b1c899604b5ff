"""bf16 and fp16 training through the engine, and fp16 overflow handling across ranks (world size 2)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, snapshot, train_ddp, train_zero

WORLD_SIZE = 2
STEPS = 30
LR = 1e-2  # larger than the parity tests' so that 30 steps visibly lower the loss
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Distance from the fp32 weights, relative to how far the fp32 weights moved from their start.
# bf16 keeps 8 significant bits (rounding 2^-9 ~ 0.2 % per cast), fp16 11 bits. Measured over these
# 30 steps: bf16 0.018-0.021, fp16 0.006-0.007 (both models, both stages); the bounds leave ~4x.
RELATIVE_DRIFT = {"bf16": 0.1, "fp16": 0.03}
# A low-precision run must achieve most of the fp32 run's drop of a held-out loss (measured: ~100 %).
MIN_SHARE_OF_FP32_DROP = 0.9
# Scale 2^8 keeps this model's fp16 gradients finite, so no step is skipped unless a test injects inf.
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "min_loss_scale": 1}


def precision_config(stage: int, precision: str) -> dict:
    return {"stage": stage, precision: FP16 if precision == "fp16" else {"enabled": True}}


def held_out_loss(model, name, dtype) -> float:
    with torch.no_grad():
        return model(*make_batch(name, 0, 10_000, 0, dtype)).item()


def relative_drift(params, reference, start) -> float:
    drift = torch.cat([(params[n] - reference[n]).flatten() for n in reference])
    travel = torch.cat([(reference[n] - start[n]).flatten() for n in reference])
    return (drift.norm() / travel.norm()).item()


def mixed_precision_worker(rank, world_size):
    rows = []
    for name in ("transformer", "mlp"):
        model_fn = partial(build_model, name)
        reference = train_ddp(model_fn, partial(make_batch, name), STEPS, lr=LR)
        start = snapshot(model_fn())
        reference_model = model_fn()
        reference_model.load_state_dict(reference.params, strict=False)  # tied head follows tok.weight
        for stage in (1, 2):
            for precision, dtype in DTYPES.items():
                result, engine, _ = train_zero(model_fn, partial(make_batch, name, dtype=dtype),
                                               precision_config(stage, precision), STEPS, lr=LR)
                rows.append({
                    "case": f"{name}, stage {stage}, {precision}",
                    "precision": precision,
                    "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
                    "start_loss": held_out_loss(model_fn(), name, torch.float32),
                    "fp32_loss": held_out_loss(reference_model, name, torch.float32),
                    "loss": held_out_loss(engine.module, name, dtype),
                    "drift": relative_drift(result.params, reference.params, start),
                    "skipped": engine.skipped_steps,
                })
    return rows


@pytest.mark.timeout(300)
def test_bf16_and_fp16_train_close_to_fp32():
    problems = []
    for rank, rows in enumerate(run_distributed(mixed_precision_worker, WORLD_SIZE, timeout=240)):
        for row in rows:
            where = f"rank {rank} [{row['case']}]"
            dtype = str(DTYPES[row["precision"]])
            fp32_drop = row["start_loss"] - row["fp32_loss"]
            if row["param_dtypes"] != [dtype]:
                problems.append(f"{where}: parameters are {row['param_dtypes']}, expected {dtype}")
            if not row["start_loss"] - row["loss"] >= MIN_SHARE_OF_FP32_DROP * fp32_drop > 0:
                problems.append(f"{where}: held-out loss {row['start_loss']:.4f} -> {row['loss']:.4f}, "
                                f"fp32 reaches {row['fp32_loss']:.4f}")
            if not row["drift"] <= RELATIVE_DRIFT[row["precision"]]:
                problems.append(f"{where}: relative drift from fp32 {row['drift']:.4f}")
            if row["skipped"] != 0:
                problems.append(f"{where}: {row['skipped']} steps skipped without an overflow")
    assert not problems, "\n".join(problems)


# -- fp16 overflow on one rank --------------------------------------------------------------------------
OVERFLOW_STEPS = 8
# (step, parameter position in model.parameters(), element): the first element of the first parameter
# and the last element of the last one. One element lives in one rank's shard; in any contiguous layout
# these two land in different ranks' shards, so each rank once sees an overflow only its peer injected.
INJECTIONS = {2: (0, 0), 5: (-1, -1)}
INJECTING_RANK = 1


def poison(index: int):
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[index] = float("inf")
        return grad
    return hook


def overflow_run(rank, stage, hysteresis) -> list[dict]:
    model = build_model("transformer")
    fp16 = {**FP16, "hysteresis": hysteresis}
    engine = zero_core.setup(model, make_optimizer(model), {"stage": stage, "fp16": fp16})
    params = list(model.parameters())
    steps = []
    for step in range(OVERFLOW_STEPS):
        before, scale, skipped = snapshot(model), engine.loss_scale, engine.skipped_steps
        handle = None
        if step in INJECTIONS and rank == INJECTING_RANK:
            position, element = INJECTIONS[step]
            handle = params[position].register_hook(poison(element))
        engine.backward(model(*make_batch("transformer", rank, step, 0, torch.float16)))
        engine.step()
        if handle is not None:
            handle.remove()
        after = snapshot(model)
        steps.append({
            "changed": any(not torch.equal(before[n], after[n]) for n in before),
            "scale_before": scale,
            "scale_after": engine.loss_scale,
            "skipped_delta": engine.skipped_steps - skipped,
        })
    return steps


def overflow_worker(rank, world_size):
    return {(stage, hysteresis): overflow_run(rank, stage, hysteresis) for stage in (1, 2) for hysteresis in (1, 2)}


def expected_scales(hysteresis: int) -> list[float]:
    """DeepSpeed's rule, step by step: an overflow halves the scale once `hysteresis` overflows are used up."""
    scale, left, scales = 2.0 ** FP16["initial_scale_power"], hysteresis, []
    for step in range(OVERFLOW_STEPS):
        if step in INJECTIONS:
            if left == 1:
                scale /= 2
            else:
                left -= 1
        scales.append(scale)
    return scales


@pytest.mark.timeout(300)
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    per_rank = run_distributed(overflow_worker, WORLD_SIZE, timeout=240)
    problems = []
    for rank, runs in enumerate(per_rank):
        for (stage, hysteresis), steps in runs.items():
            where = f"rank {rank}, stage {stage}, hysteresis {hysteresis}"
            scales = expected_scales(hysteresis)
            for step, s in enumerate(steps):
                overflow = step in INJECTIONS
                if s["changed"] == overflow:
                    problems.append(f"{where}, step {step}: parameters changed={s['changed']}, overflow={overflow}")
                if s["skipped_delta"] != int(overflow):
                    problems.append(f"{where}, step {step}: skipped_steps grew by {s['skipped_delta']}")
                if s["scale_after"] != scales[step]:
                    problems.append(f"{where}, step {step}: loss scale {s['scale_after']}, expected {scales[step]}")
    assert not problems, "\n".join(problems)
    assert expected_scales(1)[-1] < expected_scales(2)[-1] < 2.0 ** FP16["initial_scale_power"]
