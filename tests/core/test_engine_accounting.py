"""Communication volume and model-state memory per rank, against the ZeRO paper's formulas.

Psi is the trainable parameter count and N the world size. Every bound is computed here from the
model's sizes; only padding (each bucket padded to a multiple of N) and AdamW's scalar `step`
counters may add to the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from zero_core.replicated.grad_reducer import GradReducer
from models import build_model, frozen_numel, make_batch, trainable_numel, trainable_tensor_count
from reference import make_optimizer

SMALL_BUCKET = 100
DEFAULT_BUCKET = None  # the engine's defaults (DeepSpeed's 5e8 elements: one bucket per group)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FP32_BYTES = 4
ADAM_STATES = 2  # exp_avg and exp_avg_sq, fp32 each


@dataclass(frozen=True)
class Case:
    model: str
    stage: int
    precision: str
    bucket: int | None

    def config(self) -> dict:
        config = {"stage": self.stage}
        if self.bucket is not None:
            config.update(reduce_bucket_size=self.bucket, allgather_bucket_size=self.bucket)
        if self.precision == "bf16":
            config["bf16"] = {"enabled": True}
        return config


def cases() -> list[Case]:
    return [Case(model, stage, precision, bucket) for model in ("transformer", "mlp") for stage in (1, 2)
            for precision in DTYPES for bucket in (SMALL_BUCKET, DEFAULT_BUCKET)]


def max_buckets(psi: int, tensors: int, bucket: int | None) -> int:
    """At most: one bucket per `bucket` elements, plus one cut short at each tensor (or group) boundary."""
    return (1 if bucket is None else math.ceil(psi / bucket)) + tensors


def measure(case: Case, rank: int) -> dict:
    dtype = DTYPES[case.precision]
    model = build_model(case.model)
    engine = zero_core.setup(model, make_optimizer(model), case.config())

    engine.reset_comm_stats()
    with engine.no_sync():  # a micro-batch of accumulation: no traffic at all
        engine.backward(model(*make_batch(case.model, rank, 0, 0, dtype)))
    silent = engine.comm_stats()
    engine.reset_comm_stats()
    engine.backward(model(*make_batch(case.model, rank, 0, 1, dtype)))
    engine.step()
    comm = engine.comm_stats()
    memory = engine.memory_stats()

    frozen = {p for p in model.parameters() if not p.requires_grad}
    shards = [p for group in engine.optimizer.param_groups for p in group["params"]]
    shard_elements = torch.tensor(float(sum(p.numel() for p in shards)))
    dist.all_reduce(shard_elements)
    return {
        "silent": silent,
        "comm": comm,
        "memory": memory,
        "state_bytes": sum(v.numel() * v.element_size() for s in engine.optimizer.state.values()
                           for v in s.values() if torch.is_tensor(v)),
        "state_entries": len(engine.optimizer.state),
        "step_counter_bytes": torch.zeros((), dtype=torch.get_default_dtype()).element_size(),
        "frozen_in_optimizer": any(p in frozen for p in shards) or any(p in frozen for p in engine.optimizer.state),
        "shard_elements_all_ranks": int(shard_elements.item()),
    }


def accounting_worker(rank, world_size, all_cases):
    return [measure(case, rank) for case in all_cases]


# -- expectations, from the model's sizes only ---------------------------------------------------------
def sizes(case: Case, world_size: int) -> dict:
    model = build_model(case.model)
    psi, tensors = trainable_numel(model), trainable_tensor_count(model)
    buckets = max_buckets(psi, tensors, case.bucket)
    largest = max(p.numel() for p in model.parameters() if p.requires_grad)
    module_buffers = sum(b.numel() * DTYPES[case.precision].itemsize for b in model.buffers())
    return {"psi": psi, "frozen": frozen_numel(model), "n": world_size, "buckets": buckets, "tensors": tensors,
            "largest_bucket": max(largest, min(case.bucket or psi, psi)), "module_buffers": module_buffers,
            "pad_full": world_size * buckets,  # elements of padding in a whole padded buffer
            "pad_shard": buckets}  # elements of padding in one rank's shard (one per bucket at most)


def expected_memory(case: Case, s: dict) -> dict[str, tuple[int, int]]:
    """(least, most) bytes per category; most = least + padding."""
    half = DTYPES[case.precision].itemsize
    psi, frozen, n = s["psi"], s["frozen"], s["n"]
    shard = math.ceil(psi / n)
    grads_full = case.stage == 1
    master_separate = case.precision != "fp32"  # in fp32 the master shard is a view of the parameters
    return {
        "params": (half * (psi + frozen), half * (psi + frozen + s["pad_full"])),
        "grads": (half * psi, half * (psi + s["pad_full"])) if grads_full
        else (half * shard, half * (shard + s["pad_shard"])),
        "fp32_master": (FP32_BYTES * shard, FP32_BYTES * (shard + s["pad_shard"])) if master_separate
        else (0, 0),
        # The optimizer steps one piece per parameter fragment, so padding carries no state: a rank whose slices
        # end in a bucket's padding holds up to that padding less.
        "optimizer_state": (ADAM_STATES * FP32_BYTES * (shard - s["pad_full"]),
                            ADAM_STATES * FP32_BYTES * (shard + s["pad_shard"])),
    }


def communication_problems(case: Case, s: dict, r: dict) -> list[str]:
    problems = [f"no_sync backward communicated: {name} {entry}" for name, entry in r["silent"].items()
                if entry["calls"]]
    moved = r["comm"]["reduce_scatter"]["elements"] + r["comm"]["all_gather"]["elements"]
    if not 2 * s["psi"] <= moved <= 2 * (s["psi"] + s["pad_full"]):
        problems.append(f"reduce-scatter + all-gather moved {moved} elements, expected 2*Psi = {2 * s['psi']} "
                        f"(+ at most {2 * s['pad_full']} padding): {r['comm']}")
    if case.precision == "fp32":
        for name in ("reduce_scatter", "all_gather"):
            if r["comm"][name]["bytes"] != FP32_BYTES * r["comm"][name]["elements"]:
                problems.append(f"{name} bytes {r['comm'][name]} are not 4 per fp32 element")
    # All-reduce carries scalars (norms) and the step's one-byte flags: overflow, and per trainable tensor "got a
    # gradient on some rank" (docs/core-api.md, "No gradient, no step").
    flags = s["tensors"] + 1
    if not r["comm"]["all_reduce"]["bytes"] <= flags + 8 * 2:
        problems.append(f"all-reduce carried {r['comm']['all_reduce']}: only scalars and {flags} one-byte flags "
                        "should travel by all-reduce")
    return problems


def memory_problems(case: Case, s: dict, r: dict) -> list[str]:
    problems = []
    step_counters = r["state_entries"] * r["step_counter_bytes"]
    for name, (least, most) in expected_memory(case, s).items():
        most += step_counters if name == "optimizer_state" else 0
        if not least <= r["memory"][name] <= most:
            problems.append(f"memory {name} = {r['memory'][name]} bytes, expected {least}..{most}")
    if r["memory"]["optimizer_state"] != r["state_bytes"]:
        problems.append(f"memory_stats optimizer_state {r['memory']['optimizer_state']} != the optimizer's "
                        f"state tensors {r['state_bytes']} bytes")
    if r["frozen_in_optimizer"]:
        problems.append("a frozen parameter is in the optimizer or its state")
    if not s["psi"] <= r["shard_elements_all_ranks"] <= s["psi"] + s["pad_full"]:
        problems.append(f"the ranks' optimizer shards hold {r['shard_elements_all_ranks']} elements in all, "
                        f"expected Psi = {s['psi']} (+ padding; frozen: {s['frozen']})")
    return problems


def scratch_problems(case: Case, s: dict, r: dict) -> list[str]:
    # ZeRO-R's constant-size buffers: scratch depends on the bucket size, not on the model. At most
    # MAX_IN_FLIGHT + 1 buckets are staged at once, each with a staging buffer and a shard-sized output, each
    # rounded up to at most twice the request: 2 * 2 * (MAX_IN_FLIGHT + 1) largest buckets.
    itemsize = DTYPES[case.precision].itemsize
    bound = 4 * (GradReducer.MAX_IN_FLIGHT + 1) * s["largest_bucket"] * itemsize
    scratch = r["memory"]["buffers"] - s["module_buffers"]
    if case.bucket == SMALL_BUCKET and not scratch <= bound:
        return [f"scratch {scratch} bytes with {SMALL_BUCKET}-element buckets: above {bound} bytes, a constant "
                f"multiple of the largest bucket ({s['largest_bucket']} elements)"]
    return []


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def measured(request):
    """One spawn per world size; the tests below read its results."""
    world_size = request.param
    return world_size, run_distributed(accounting_worker, world_size, cases(), timeout=240)


def problems_of(measured, checker) -> str:
    world_size, per_rank = measured
    lines = [f"rank {rank} [{case}]: {problem}" for rank, results in enumerate(per_rank)
             for case, r in zip(cases(), results, strict=True)
             for problem in checker(case, sizes(case, world_size), r)]
    return "\n".join(lines)


@pytest.mark.timeout(300)
def test_communication_is_two_psi_per_step(measured):
    problems = problems_of(measured, communication_problems)
    assert not problems, problems


@pytest.mark.timeout(300)
def test_model_state_memory_follows_the_paper(measured):
    problems = problems_of(measured, memory_problems)
    assert not problems, problems


@pytest.mark.timeout(300)
def test_scratch_buffers_are_bounded_by_the_bucket_size(measured):
    problems = problems_of(measured, scratch_problems)
    assert not problems, problems


def test_padding_allowance_is_smaller_than_what_it_must_tell_apart():
    """The allowances must not hide a frozen module's optimizer state or an unsharded optimizer."""
    for world_size in (2, 4):
        for case in cases():
            s = sizes(case, world_size)
            assert s["pad_full"] < s["frozen"] or s["frozen"] == 0
            assert ADAM_STATES * FP32_BYTES * s["pad_shard"] < ADAM_STATES * FP32_BYTES * s["psi"] * (1 - 1 / world_size)
