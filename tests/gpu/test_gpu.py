"""The GPU tier (marker ``cuda``): the stages against plain bf16 autocast training on one GPU, the Lightning
example and an Accelerate launch on a GPU. Skipped where CUDA is absent."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from launch import run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cuda


def _run(cmd: list, cwd: Path, timeout: int = 600) -> str:
    # The GPU tier keeps the caller's environment as it is (its GPUs, threads and PYTHONPATH).
    return run(cmd, timeout=timeout, env=dict(os.environ), cwd=cwd, stderr_apart=True)


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "runs.pt"
    _run([sys.executable, Path(__file__).with_name("gpu_workers.py"), out], cwd=REPO)
    return torch.load(out, weights_only=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_trains_like_plain_bf16_autocast(gpu_runs, stage):
    plain, zero = gpu_runs["plain"], gpu_runs[f"zero{stage}"]
    # bf16 weights (engine) against bf16 autocast on fp32 weights (plain): the same curve within bf16 noise.
    for a, b in zip(plain["losses"], zero["losses"]):
        assert abs(a - b) <= 2e-2 * abs(a), (plain["losses"], zero["losses"])
    assert zero["losses"][-1] < zero["losses"][0]
    for name, value in plain["weights"].items():
        assert (zero["weights"][name] - value).abs().max().item() <= 2e-2, name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_give_their_memory_back_after_the_step(gpu_runs, stage):
    """On CUDA, after a step the engine holds no gradient memory until the next backward reduces into it
    (zero_core/grad_memory.py), as plain training with zero_grad(set_to_none=True)."""
    assert gpu_runs[f"zero{stage}"]["grads_held_after_step"] == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_bf16_step_never_waits_for_the_gpu(gpu_runs, stage):
    """Forward, backward and step of stages 1-3 in bf16 make no synchronising CUDA call (torch's sync debug mode),
    as plain autocast training makes none: the host queues the next work while the GPU runs. The one place the
    engine must read the GPU, fp16's overflow flag, is not in a bf16 run; the agreement on which parameters got
    a gradient is read only where some did not (engine._agree_on_step). The control run's ``loss.item()`` is
    caught, so the detector works."""
    syncs = gpu_runs["host_syncs"]
    assert syncs["control"], "the sync detector missed a deliberate loss.item()"
    assert not syncs["plain"], "\n".join(syncs["plain"])
    assert not syncs[f"zero{stage}"], "\n".join(syncs[f"zero{stage}"])


def test_stage3_gathers_and_reduces_on_side_streams(gpu_runs):
    """Every all-gather stage 3 issued in training ran on its gather stream and every reduce-scatter on its reduce
    stream (zero_core/stage3/streams.py), and the events ordering them lose nothing: the same weights, bit for
    bit, as stage 3 run in program order on the compute stream."""
    streamed, in_order = gpu_runs["zero3"], gpu_runs["zero3_in_order"]
    issued = streamed["issued_on_side_stream"]
    assert issued["all_gather"] and all(issued["all_gather"]), issued["all_gather"]
    assert issued["reduce_scatter"] and all(issued["reduce_scatter"]), issued["reduce_scatter"]
    assert streamed["losses"] == in_order["losses"]
    for name, value in in_order["weights"].items():
        assert torch.equal(streamed["weights"][name], value), name


def test_a_checkpoint_resumes_on_the_gpu_as_if_never_stopped(gpu_runs):
    """Save halfway, load into a fresh engine, go on: the same losses and weights, bit for bit, as the run that
    never stopped (the fused CUDA step takes its step counts on the GPU, wherever the checkpoint left them)."""
    continuous, resumed = gpu_runs["zero2"], gpu_runs["zero2_resumed"]
    assert resumed["losses"] == continuous["losses"]
    for name, value in continuous["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


@pytest.mark.parametrize("run", ["zero2_pinned", "zero3_pinned", "zero3_pageable"])
def test_overlapped_offloaded_step_equals_the_inline_step_on_the_gpu(gpu_runs, run):
    """offload_optimizer.overlap_with_forward (opt-in): the host step runs on a thread while the next forward
    starts, each unit's gather waiting on a stream event for its write-back; bit for bit the inline step."""
    overlapped, inline = gpu_runs[f"overlap_{run}_True"], gpu_runs[f"overlap_{run}_False"]
    assert overlapped["overlapped"] == len(overlapped["losses"]) - 1 and inline["overlapped"] == 0
    assert overlapped["losses"] == inline["losses"], (overlapped["losses"], inline["losses"])
    for name, value in inline["weights"].items():
        assert torch.equal(overlapped["weights"][name], value), name


@pytest.mark.parametrize("run", ["zero3_pinned", "zero3_pageable", "zero2_pinned"])
def test_steps_started_during_backward_equal_the_inline_step_on_the_gpu(gpu_runs, run):
    """offload_optimizer.overlap_with_backward (opt-in, stages 2-3): each unit's (stage 2: each bucket's) host step
    starts once its gradients' copy to the host (a CUDA event on the copy stream) has landed, during backward; bit
    for bit the inline step."""
    early, inline = gpu_runs[f"overlap_backward_{run}"], gpu_runs[f"overlap_{run}_False"]
    assert early["early"] > 0 and early["overlapped"] == len(early["losses"]) - 1, early["early"]
    assert early["losses"] == inline["losses"], (early["losses"], inline["losses"])
    for name, value in inline["weights"].items():
        assert torch.equal(early["weights"][name], value), name


@pytest.mark.parametrize("stage", [2, 3])
def test_the_compiled_host_kernel_follows_the_fused_one_on_the_gpu(gpu_runs, stage):
    """offload_optimizer.host_kernel: compiled: bf16 gradients copied to bf16 pinned buffers (no cast) and stepped
    by the compiled kernel; started during backward bit for bit its inline step, and following the fused inline
    step. The kernels round differently (about 1e-9 after a step); once that flips a bf16 weight, Adam's normalised
    update moves near-zero gradients' weights apart by about the learning rate per step (this model on CPU: 2.4e-7
    after the first step, 2.0e-3 after six), so the weights are compared to within the steps taken, as in
    test_offloaded_step_trains_like_the_step_on_the_gpu (tests/offload/test_offload_compiled_kernel.py checks the
    kernels 1e-5 apart where clipping keeps the gradients away from zero)."""
    inline, early = gpu_runs[f"compiled_zero{stage}_inline"], gpu_runs[f"compiled_zero{stage}_backward"]
    fused = gpu_runs[f"overlap_zero{stage}_pinned_False"]
    assert inline["grad_dtypes"] == ["torch.bfloat16"] and fused["grad_dtypes"] == ["torch.float32"]
    assert early["early"] > 0, early["early"]
    assert early["losses"] == inline["losses"], (early["losses"], inline["losses"])
    for name, value in inline["weights"].items():
        assert torch.equal(early["weights"][name], value), name
        gap = (value.float() - fused["weights"][name].float()).abs().max().item()
        assert gap <= len(inline["losses"]) * 1e-3, (name, gap)  # AdamW, lr 1e-3
    for a, b in zip(fused["losses"], inline["losses"]):
        assert abs(a - b) <= 1e-3 * abs(a), (fused["losses"], inline["losses"])


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gradients_leave_the_gpu_once_copied_to_the_host(gpu_runs, stage, clip):
    """Stages 2-3 with offload_optimizer cpu: after backward no gradient shard holds GPU memory (each gave it back
    once its copy to the pinned host buffer was under way; stage 2's bucket reduced last lends its shard from the
    reducer's staging and holds none of its own), and the run is the one that keeps them until the step: bit
    for bit without clipping; with clipping, whose norm comes from the norms each shard kept (foreach norms over
    other lists of shards: expected equal, but not promised), within what a flipped bf16 weight moves Adam (about
    the learning rate per step, as in test_offloaded_step_trains_like_the_step_on_the_gpu; the CPU tests check the
    kept norms bit for bit).
    A gradient read between backward and step comes back from the host. Setup makes no fp32 master on the GPU:
    its peak is the fp32 model built there, not that and an fp32 copy of it."""
    moved, kept = gpu_runs[f"grads_zero{stage}_moved_{clip}"], gpu_runs[f"grads_zero{stage}_kept_{clip}"]
    assert moved["moved"] > 0 and kept["moved"] == 0, (moved["moved"], kept["moved"])
    assert all(h == 0 for h in moved["held"]) and all(h > 0 for h in kept["held"]), (moved["held"], kept["held"])
    exact = clip == 0.0
    steps = len(kept["losses"])
    for a, b in zip(moved["losses"], kept["losses"]):
        assert a == b if exact else abs(a - b) <= 1e-3 * abs(b), (moved["losses"], kept["losses"])
    for name, value in kept["masters"].items():
        gap = (moved["masters"][name] - value).abs().max().item()
        assert gap <= (0.0 if exact else steps * 1e-3), (name, gap)
    for a, b in zip(moved["grads"], kept["grads"]):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-2, atol=1e-4)
    assert moved["setup_peak"] <= 1.25 * moved["fp32_bytes"] + 2**20, (  # over what earlier runs left live
        moved["setup_peak"], moved["fp32_bytes"], moved["live"])
    print(f"stage {stage}, clip {clip}: peak GPU bytes in training {moved['peak']} moved, {kept['peak']} kept")


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_written_to_nvme_leave_the_gpu(gpu_runs, stage):
    """Stages 2-3 with offload_optimizer nvme: after backward no gradient shard holds GPU memory (each was staged
    into pinned memory from the copy stream and written to the swap file on a thread, nvme_grads.py), and the run
    is bit for bit the one that keeps them until the step; a gradient read between backward and step comes back
    from the file."""
    moved, kept = gpu_runs[f"grads_zero{stage}_nvme_moved"], gpu_runs[f"grads_zero{stage}_nvme_kept"]
    assert moved["moved"] > 0 and kept["moved"] == 0, (moved["moved"], kept["moved"])
    assert all(h == 0 for h in moved["held"]) and all(h > 0 for h in kept["held"]), (moved["held"], kept["held"])
    assert moved["losses"] == kept["losses"], (moved["losses"], kept["losses"])
    for name, value in kept["masters"].items():
        assert torch.equal(moved["masters"][name], value), name
    for a, b in zip(moved["grads"], kept["grads"]):
        assert torch.equal(a, b)
    print(f"stage {stage}, nvme: peak GPU bytes in training {moved['peak']} written out, {kept['peak']} kept")


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_update_copies_into_the_model_without_a_host_wait(gpu_runs, stage):
    """offload_optimizer.delayed_update_after: the step call copies the landed masters into the model on the copy
    stream and returns; each part's gather waits for its copies (a stream wait) and the thread for all of them
    before it changes the masters. With those copies held up on the GPU, the run is bit for bit the one whose step
    call waits for them on the host."""
    free, waited = gpu_runs[f"delayed_zero{stage}_False"], gpu_runs[f"delayed_zero{stage}_True"]
    assert free["delayed"] == waited["delayed"] == len(free["losses"]) - 1, (free["delayed"], waited["delayed"])
    assert free["losses"] == waited["losses"], (free["losses"], waited["losses"])
    for name, value in waited["weights"].items():
        assert torch.equal(free["weights"][name], value), name


@pytest.mark.parametrize("label, stage", [("zero2_offload", 2), ("zero3_offload", 3), ("zero3_offload_param", 3),
                                          ("zero3_offload_pageable", 3)])  # gpu_workers.OFFLOADS
def test_offloaded_step_trains_like_the_step_on_the_gpu(gpu_runs, label, stage):
    """The optimizer on the host (gradients copied out during backward and cast on the GPU, updated masters
    copied back and cast there, asynchronously): after every step the model's bf16 parameters are exactly the
    updated masters, cast (the write-back arrived before the next forward), and the run follows the one that steps
    on the GPU. The two fused kernels (CPU and CUDA) round differently in the last fp32 bit; once that flips a bf16
    weight, Adam's normalised update can move near-zero gradients' weights apart by about the learning rate per
    step (1e-3 here), so the weights are compared to within the steps taken."""
    reference, offloaded = gpu_runs[f"zero{stage}"], gpu_runs[label]
    assert offloaded["written_back"] == [True] * len(reference["losses"])
    pinned = offloaded["host_pinned"]  # pin_memory: the host masters and gradient buffers are page-locked
    assert pinned and all(pinned) == (label != "zero3_offload_pageable"), pinned
    for a, b in zip(reference["losses"], offloaded["losses"]):
        assert abs(a - b) <= 1e-3 * abs(a), (reference["losses"], offloaded["losses"])
    steps = len(reference["losses"])
    for name, value in reference["weights"].items():
        assert (offloaded["weights"][name] - value).abs().max().item() <= steps * 1e-3, name


def test_peak_memory_stays_within_the_engine_state_plus_one_model_of_activations(gpu_runs):
    plain_peak = gpu_runs["plain"]["peak"]
    for stage in (1, 2, 3):
        zero = gpu_runs[f"zero{stage}"]
        state = sum(zero["memory"].values())  # what the engine measures it holds (estimator's classes)
        assert zero["peak"] <= plain_peak + state, (stage, zero["peak"], plain_peak, zero["memory"])


@pytest.mark.timeout(900)
def test_lightning_example_trains_on_one_gpu(tmp_path):
    _run([sys.executable, REPO / "examples" / "lightning_gpt.py", "fit", "--trainer.accelerator", "gpu",
          "--trainer.devices", "1", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "20",
          "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2"], cwd=tmp_path)
    assert (tmp_path / "lightning_gpt" / "model-bf16").is_dir()


@pytest.mark.timeout(900)
def test_accelerate_example_launches_on_one_gpu(tmp_path):
    config = tmp_path / "zero.yaml"
    config.write_text("distributed_type: 'NO'\nnum_processes: 1\nmixed_precision: bf16\n"
                      "zero_optimization:\n  stage: 3\n")
    _run([sys.executable, "-m", "accelerate_zero", "launch", "--config", config,
          REPO / "examples" / "accelerate_train.py"], cwd=tmp_path)


@pytest.mark.timeout(900)
def test_gpu_benchmark_runs_every_implementation(tmp_path):
    out = tmp_path / "bench.json"
    _run([sys.executable, "-m", "benchmarks.gpu", "--preset", "tiny", "--steps", "3", "--repeats", "1",
          "--json", out], cwd=REPO)
    rows = json.loads(out.read_text())["tiny"]
    assert set(rows) == {"plain", "fsdp2", "zero1", "zero2", "zero3"}
