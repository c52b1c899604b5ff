"""Optimizer offload (zero_core/offload): CPU masters and NVMe swap train to DDP's weights at stages 1-3.

One spawn per world size runs every case with the DDP reference in the same processes; tiles are made small
(sub_group_size) so every step runs several tiles, and the NVMe swap double-buffers across them.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial

import pytest
import torch

from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, make_sgd, train_ddp
from zero_core.tools.estimator import estimate_stage, model_info
from zero_core.offload.estimate import HOST_GRAD_BYTES, MASTER_BYTES, placement_bytes
from stage3_support import train_engine

STEPS = 6
WEIGHT_TOLERANCE = 1e-5
CLIP = {"transformer": 0.5, "mlp": 0.05}
SMALL = {"reduce_bucket_size": 100, "allgather_bucket_size": 100, "sub_group_size": 120}


def make_rmsprop(model, lr):
    """An optimizer torch has no fused CPU kernel for: it still works, with a one-time note."""
    return torch.optim.RMSprop(model.parameters(), lr=lr)


OPTIMIZERS = {"adamw": make_optimizer, "sgd": make_sgd, "rmsprop": make_rmsprop}


@dataclass(frozen=True)
class Case:
    stage: int
    device: str  # offload_optimizer.device
    model: str = "transformer"
    accumulation: int = 2
    clip: bool = True
    optimizer: str = "adamw"
    options: dict = field(default_factory=lambda: dict(SMALL))

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    def config(self, nvme_dir: str) -> dict:
        block = {"device": self.device, **({"nvme_path": nvme_dir} if self.device == "nvme" else {})}
        options = dict(self.options)
        if options.get("offload_param", {}).get("device") == "nvme":
            options["offload_param"] = {**options["offload_param"], "nvme_path": nvme_dir}
        return {"stage": self.stage, "param_persistence_threshold": 0, "offload_optimizer": block,
                "aio": {"block_size": 256, "queue_depth": 2, "thread_count": 2}, **options}


def cases() -> list[Case]:
    out = [Case(stage, device) for stage in (1, 2, 3) for device in ("cpu", "nvme")]
    return out + [
        Case(2, "cpu", optimizer="sgd", accumulation=1),
        Case(1, "nvme", optimizer="rmsprop", clip=False),
        Case(3, "nvme", model="mlp", options={"gradient_clipping": 0.05}),  # frozen params; clipping in step()
        Case(3, "nvme", options={}),  # default buckets and sub_group_size: one tile
        Case(2, "nvme", options={**SMALL, "aio": {"single_submit": True, "overlap_events": False}}),
        Case(3, "cpu", options={**SMALL, "offload_param": {"device": "cpu"}}),  # parameter shards in host memory
        Case(3, "nvme", model="mlp", options={**SMALL, "offload_param": {"device": "cpu", "pin_memory": True}}),
        # parameter shards in a file too (ZeRO-Infinity): all of them, through 2 buffers
        Case(3, "nvme", options={**SMALL, "offload_param": {"device": "nvme", "max_in_cpu": 0, "buffer_count": 2}}),
        # the first 150 elements of shards stay in host memory, the rest in a file read through one buffer
        Case(3, "cpu", model="mlp", options={**SMALL, "offload_param": {"device": "nvme", "max_in_cpu": 150,
                                                                       "buffer_count": 1}}),
        # small units stay gathered (persistent); their shards are in the file all the same
        Case(3, "cpu", options={**SMALL, "param_persistence_threshold": 40,
                                "offload_param": {"device": "nvme", "max_in_cpu": 0}}),
    ]


def run_case(case: Case, nvme_dir: str) -> dict:
    clip = CLIP[case.model] if case.clip else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, engine = train_engine(partial(build_model, case.model), partial(make_batch, case.model),
                                      case.config(nvme_dir), STEPS, case.accumulation, clip,
                                      optimizer_fn=OPTIMIZERS[case.optimizer])
    offload = engine._offload
    swap_files = sorted(os.listdir(nvme_dir))
    memory = engine.memory_stats()
    inner = engine.inner_optimizers[0]
    report = {
        "result": result,
        "notes": [str(w.message) for w in caught if "fused CPU kernel" in str(w.message)],
        # a config asking for offload gets no other warning about it (it once said "not implemented")
        "offload_warnings": [str(w.message) for w in caught
                             if "offload" in str(w.message).lower() and "fused CPU kernel" not in str(w.message)],
        "fused": [g.get("fused") for g in inner.param_groups],
        "masters_on_cpu": all(m.device.type == "cpu" for m in offload.all_masters()),
        "masters_apart": all(m.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
                             for part in engine.runtime.parts for m, s in zip(part.masters, part.grad_shards())),
        "swap_file": offload.swapper.path if offload.swapper else None,
        "param_shards_apart": all((u.shard.numel() == 0 and u.swap is not None)
                                  or u.shard.untyped_storage().data_ptr() != u.full.untyped_storage().data_ptr()
                                  and u._source is None for u in getattr(engine.runtime, "units", [])),
        # fp32 parameter shards in host memory (this CPU run) are their own masters with device 'cpu'
        "masters_are_shards": all(m.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                                  for part in engine.runtime.parts if getattr(part, "swap", None) is None
                                  for m, s in zip(part.master_shards.buckets, part.param_shards())),
        "units_in_file": sum(1 for u in getattr(engine.runtime, "units", []) if u.swap is not None),
        "units_in_host": sum(1 for u in getattr(engine.runtime, "units", []) if u.swap is None and u.shard.numel()),
        "swap_files": swap_files,
        "resident_master_bytes": memory["fp32_master"],
        "resident_state_bytes": memory["optimizer_state"],
        "scalar_state_bytes": sum(v.numel() * v.element_size() for state in inner.state.values()
                                  for v in state.values() if torch.is_tensor(v) and v.dim() == 0),
    }
    if case.device == "cpu" and case.optimizer == "adamw" and "offload_param" not in case.options:
        # zero-estimate's host bytes against what this rank holds: masters, Adam state, host gradient buffers
        estimate = estimate_stage(model_info(build_model(case.model)), case.config(nvme_dir), engine.topology.world_size)
        host = memory["fp32_master"] + memory["optimizer_state"] - report["scalar_state_bytes"]
        host += sum(g.numel() * g.element_size() for g in offload.grads.buffers.values())
        # (on this CPU run fp32 gradient and parameter shards are already host memory: the gradients are used in
        # place, and the master is the parameter shard itself, as without offload)
        in_place = (HOST_GRAD_BYTES + MASTER_BYTES) * estimate.shard_numel
        report["host_estimate"] = (host, placement_bytes(estimate, case.config(nvme_dir)).host - in_place)
    if case.device == "nvme" and case.optimizer == "adamw" and "offload_param" not in case.options:
        # zero-estimate's NVMe bytes against what the swap file holds: each master and its two moments
        swapper = offload.swapper
        in_file = sum(shape.numel() * dtype.itemsize for shape, dtype in swapper._shapes.values())
        if case.stage >= 2:  # and, on CUDA, each reduced gradient shard (nvme_grads.py; the CPU keeps them)
            in_file += sum(part.grad_view(b).numel() * part.grad_view(b).element_size()
                           for part in offload.parts for b in range(len(part.layout.buckets)))
        estimate = estimate_stage(model_info(build_model(case.model)), case.config(nvme_dir),
                                  engine.topology.world_size)
        report["nvme_estimate"] = (in_file, placement_bytes(estimate, case.config(nvme_dir)).nvme)
    if getattr(engine.runtime, "param_swap", None) is not None:
        swap = engine.runtime.param_swap  # buffers not held by a gather: free, or holding a read ahead
        report["param_swap_buffers_free"] = -1 if swap._held else len(swap._free) + len(swap._ahead)
        # zero-estimate's NVMe bytes for the parameter shards against what the file holds
        only_params = {k: v for k, v in case.config(nvme_dir).items() if k != "offload_optimizer"}
        estimate = estimate_stage(model_info(build_model(case.model)), only_params, engine.topology.world_size)
        in_file = sum(u.swapped_shard[0] * u.swapped_shard[1].itemsize for u in engine.runtime.units
                      if u.swap is not None and u.trainable)
        report["param_nvme_estimate"] = (in_file, placement_bytes(estimate, only_params).nvme)
    engine.remove_offload_files()
    report["after_close"] = sorted(os.listdir(nvme_dir))
    return report


FP16 = {"enabled": True, "initial_scale_power": 8}  # keeps this model's fp16 gradients finite
PRECISION_CASES = [(2, "bf16", "cpu"), (2, "bf16", "nvme"), (3, "fp16", "cpu"), (1, "fp16", "nvme"), (1, "bf16", "cpu"),
                   (3, "bf16", "nvme+params")]  # parameter shards in a file too


def mixed_precision_diffs(nvme_dir: str) -> list[float]:
    """16-bit training offloaded against the same run without offload: the same arithmetic on the masters.
    With device 'cpu' the 16-bit gradient shards are copied to the host as they are reduced (checked)."""
    diffs = []
    for stage, precision, device in PRECISION_CASES:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        base = {"stage": stage, "param_persistence_threshold": 0, **SMALL,
                precision: FP16 if precision == "fp16" else {"enabled": True}}
        runs = []
        for offload in (None, {"device": device.removesuffix("+params"), "nvme_path": nvme_dir}):
            config = {**base, **({"offload_optimizer": offload} if offload else {})}
            if offload and device.endswith("+params"):
                config["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0}
            result, engine = train_engine(partial(build_model, "transformer"),
                                          partial(make_batch, "transformer", dtype=dtype), config, STEPS, 2,
                                          CLIP["transformer"])
            runs.append(result.params)
            if engine._offload is not None and device == "cpu" and engine._offload.grads.copied_during_backward == 0:
                raise AssertionError(f"stage {stage} {precision}: no gradient was copied to the host during backward")
            engine.remove_offload_files()
        diffs.append(max((runs[0][n] - runs[1][n]).abs().max().item() for n in runs[0]))
    return diffs


def setup_errors(nvme_dir: str) -> list[str]:
    """A bad nvme_path fails in setup, before any training, naming the field."""
    import zero_core

    messages = []
    bad = [{"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": path}}
           for path in (os.path.join(nvme_dir, "missing"), __file__)]
    bad.append({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0,
                                              "buffer_size": 2}})
    for config in bad:
        model = build_model("mlp")
        try:
            zero_core.setup(model, make_optimizer(model), config)
        except ValueError as error:
            messages.append(str(error))
    return messages


def offload_worker(rank, world_size, all_cases):
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-offload-{rank}-")
    references, results = {}, []
    for case in all_cases:
        key = (case.model, case.accumulation, case.clip or "gradient_clipping" in case.options, case.optimizer)
        if key not in references:
            clip = CLIP[case.model] if key[2] else None
            references[key] = train_ddp(partial(build_model, case.model), partial(make_batch, case.model), STEPS,
                                        case.accumulation, clip, optimizer_fn=OPTIMIZERS[case.optimizer])
        try:
            report = run_case(case, nvme_dir)
        except Exception as error:
            error.add_note(f"in case: {case.label()}")
            raise
        ref = references[key]
        result = report.pop("result")
        report["max_dw"] = max((result.params[n] - ref.params[n]).abs().max().item() for n in ref.params)
        report["losses_match"] = torch.allclose(torch.tensor(result.losses), torch.tensor(ref.losses), rtol=1e-5)
        report["norms_match"] = not case.clip or torch.allclose(torch.tensor(result.norms), torch.tensor(ref.norms),
                                                                rtol=1e-5)
        results.append(report)
    return results, setup_errors(nvme_dir), nvme_dir, mixed_precision_diffs(nvme_dir)


def check(case: Case, r: dict) -> list[str]:
    problems = []
    if not r["max_dw"] <= WEIGHT_TOLERANCE:
        problems.append(f"max |w - w_ddp| = {r['max_dw']:.3g}")
    if not (r["losses_match"] and r["norms_match"]):
        problems.append("losses or clip norms differ from DDP's")
    fused = case.optimizer != "rmsprop"
    if fused != all(r["fused"]) or bool(r["notes"]) == fused or len(r["notes"]) > 1:
        problems.append(f"fused flags {r['fused']} / notes {r['notes']} wrong for {case.optimizer}")
    if not (r["masters_on_cpu"] and r["masters_apart"] and r["param_shards_apart"]):
        problems.append("masters are not separate CPU tensors")
    if case.device == "nvme":
        if os.path.basename(r["swap_file"]) not in r["swap_files"] or r["after_close"]:
            problems.append(f"swap file {r['swap_file']}: during {r['swap_files']}, after close {r['after_close']}")
        if r["resident_master_bytes"] or r["resident_state_bytes"] != r["scalar_state_bytes"]:
            problems.append(f"NVMe state still resident between steps: {r['resident_master_bytes']} master, "
                            f"{r['resident_state_bytes']} optimizer bytes")
    elif r["resident_state_bytes"] == 0 or not r["masters_are_shards"]:
        problems.append("CPU offload of fp32 CPU shards should keep state in memory and step the shards themselves")
    param_device = case.options.get("offload_param", {}).get("device")
    if param_device == "nvme":
        max_in_cpu = case.options["offload_param"]["max_in_cpu"]
        if r["units_in_file"] == 0 or (r["units_in_host"] > 0) != (max_in_cpu > 0):
            problems.append(f"{r['units_in_file']} units in the file, {r['units_in_host']} in host memory")
        if r["param_swap_buffers_free"] != case.options["offload_param"].get("buffer_count", 5):
            problems.append("a parameter swap buffer was not given back")
    if case.options.get("offload_param", {}).get("max_in_cpu") == 0:
        in_file, estimated = r["param_nvme_estimate"]
        if in_file != estimated:
            problems.append(f"zero-estimate says {estimated} NVMe bytes of parameters, the file holds {in_file}")
    if r["offload_warnings"]:
        problems.append(f"warnings about offload: {r['offload_warnings']}")
    if "nvme_estimate" in r:
        in_file, estimated = r["nvme_estimate"]  # within the shards' padding and uneven split
        if abs(in_file / estimated - 1) > 0.02:
            problems.append(f"zero-estimate says {estimated} NVMe bytes of optimizer state, the file holds {in_file}")
    if "host_estimate" in r:
        measured, estimated = r["host_estimate"]
        if abs(measured / estimated - 1) > 0.02:
            problems.append(f"zero-estimate says {estimated} host bytes, the engine holds {measured}")
    return problems


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_matches_ddp(world_size):
    all_cases = cases()
    per_rank = run_distributed(offload_worker, world_size, all_cases, timeout=360)
    problems = [f"rank {rank} [{case.label()}]: {p}" for rank, (results, *_) in enumerate(per_rank)
                for case, r in zip(all_cases, results, strict=True) for p in check(case, r)]
    assert not problems, "\n".join(problems)
    for results, errors, nvme_dir, precision_diffs in per_rank:
        # Offloaded: the fused CPU kernel; not offloaded: torch's default CPU Adam. Both round to 16 bits alike.
        assert max(precision_diffs) <= 1e-6, list(zip(PRECISION_CASES, precision_diffs))
        assert os.listdir(nvme_dir) == []
        assert len(errors) == 3, errors
        assert "offload_optimizer.nvme_path" in errors[0] and "not an existing directory" in errors[0]
        assert "not an existing directory" in errors[1]
        assert "offload_param.buffer_size=2 elements is smaller than this rank's largest" in errors[2]
        os.rmdir(nvme_dir)


def test_estimate_by_place():
    config = {"stage": 3, "bf16": {"enabled": True}, "sub_group_size": 1000,
              "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2},
              "offload_param": {"device": "cpu"}}
    estimate = estimate_stage(10_000, config, 4)
    place = placement_bytes(estimate, config)
    shard = 2500
    # fp32 master + Adam's two moments, and the bf16 gradient shard written out during backward (nvme_grads.py)
    assert place.nvme == shard * (4 + 8) + shard * 2
    # the param shard, tiles, the tile's gradients and the next one's read ahead
    assert place.host == shard * 2 + (3 + 2) * 1000 * 12 + 2 * 4 * 1000
    assert place.accelerator == (estimate.total - estimate.fp32_master - estimate.optimizer_state - shard * 2
                                 - estimate.grads)  # the parameter shard and the gradient shard left
    # parameter shards in the file beyond max_in_cpu elements, read through buffer_count buffers
    config["offload_param"] = {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 500, "buffer_count": 3,
                               "buffer_size": 100}
    nvme = placement_bytes(estimate, config)
    assert nvme.nvme == place.nvme + (shard - 500) * 2
    assert nvme.host == place.host - shard * 2 + 500 * 2 + 3 * 100 * 2
    assert nvme.accelerator == place.accelerator
    # device cpu at stages 2-3: the reduced gradient shards leave the accelerator as backward copies them to the
    # host (stage 1's stay: its buckets view one buffer)
    cpu = {"stage": 3, "bf16": {"enabled": True}, "offload_optimizer": {"device": "cpu"}}
    on_cpu = placement_bytes(estimate, cpu)
    assert on_cpu.accelerator == estimate.total - estimate.fp32_master - estimate.optimizer_state - estimate.grads
    assert estimate.grads == shard * 2
    stage2 = estimate_stage(10_000, {**cpu, "stage": 2}, 4)
    assert placement_bytes(stage2, {**cpu, "stage": 2}).accelerator == (  # (the step's fp32 tile is on the host)
        stage2.total - stage2.fp32_master - stage2.optimizer_state - stage2.step_tile - stage2.grads)
    assert stage2.grads == shard * 2
    stage1 = estimate_stage(10_000, {**cpu, "stage": 1}, 4)
    assert placement_bytes(stage1, {**cpu, "stage": 1}).accelerator == (
        stage1.total - stage1.fp32_master - stage1.optimizer_state - stage1.step_tile)


def test_full_disk_is_an_error_before_training(monkeypatch, tmp_path):
    from zero_core.offload import nvme_swap

    monkeypatch.setattr(nvme_swap.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1024})())
    with pytest.raises(ValueError, match=r"offload_optimizer.nvme_path=.* has 0.00 GiB free .* needs about"):
        nvme_swap.check_nvme_path(str(tmp_path), "zero_optimization.offload_optimizer.nvme_path", 10 * 2**30)
