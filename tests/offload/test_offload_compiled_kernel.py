"""The compiled host kernel (``offload_optimizer.host_kernel: compiled``; offload/compiled_adam.py).

The kernel alone against torch's own Adam and AdamW (fused, fp32 gradients: the 16-bit ones upcast and scaled), with
weight decay, maximize and a gradient scale, over several steps; a step in chunks is bit for bit the whole step.
Then two ranks at stages 2 and 3 (also with ``offload_param: cpu``, and in fp16 with a loss scale; bf16, clipping
and an LR scheduler, AdamW with and without weight decay by group) train the same steps with the fused kernel, with
the compiled one, and with the compiled one on the overlapped step's thread (forced on: it acts only beside an
accelerator): the compiled run follows the fused run to within the kernels' rounding, keeps no fp32 host gradient
buffer, and the overlapped run is bit for bit the inline compiled run; so is, without clipping, the run whose parts'
steps start during backward. What it cannot step is refused with the field named."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, make_scheduler
from stage3_support import full_params

from zero_core.config import ZeroConfigError
from zero_core.offload import compiled_adam
from zero_core.offload.estimate import placement_bytes
from zero_core.tools.estimator import estimate_stage

MODEL = "transformer"
STEPS = 4
SMALL = {"reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
FIELD = "zero_optimization.offload_optimizer.host_kernel"


@pytest.mark.parametrize("cls, options", [(torch.optim.AdamW, {"weight_decay": 0.01}),
                                          (torch.optim.Adam, {"weight_decay": 0.1}),
                                          (torch.optim.AdamW, {"maximize": True})])
def test_the_kernel_steps_as_torch_adam_with_16_bit_gradients(cls, options):
    gen = torch.Generator().manual_seed(0)
    numel, scale = 1000, 0.5
    reference = torch.nn.Parameter(torch.randn(numel, generator=gen))
    optimizer = cls([reference], lr=1e-2, fused=True, **options)
    param, avg, sq = reference.detach().clone(), torch.zeros(numel), torch.zeros(numel)
    for step in range(1, 6):
        grad = torch.randn(numel, generator=gen).bfloat16()
        reference.grad = grad.float() * scale
        optimizer.step()
        group = optimizer.param_groups[0]
        compiled_adam.kernel()(param, grad, avg, sq, compiled_adam.scalars(group, step, scale))
        moved = (reference.detach() - param).abs().max().item()
        assert moved < 2e-6, (step, moved)  # ~1e-9 per step from the order of operations, over lr 1e-2 moves
    assert not torch.equal(reference.detach(), torch.zeros(numel))


def test_a_step_in_chunks_is_bit_for_bit_the_whole_step():
    gen = torch.Generator().manual_seed(1)
    whole = [torch.randn(1000, generator=gen), torch.rand(1000, generator=gen), torch.rand(1000, generator=gen)]
    chunked = [tensor.clone() for tensor in whole]
    grad = torch.randn(1000, generator=gen).bfloat16()
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01, "eps": 1e-8, "decoupled_weight_decay": True}
    scalars = compiled_adam.scalars(group, 3, 0.7)
    compiled_adam.kernel()(whole[0], grad, whole[1], whole[2], scalars)
    for lo, hi in ((0, 320), (320, 640), (640, 1000)):  # 64-element cuts, as the engine's chunks
        compiled_adam.kernel()(chunked[0][lo:hi], grad[lo:hi], chunked[1][lo:hi], chunked[2][lo:hi], scalars)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_a_one_element_row_steps_as_the_same_element_of_a_longer_row_without_a_new_kernel():
    """A piece of 65 elements stepped whole, and as the engine's chunks cut it (64, then 1): the same bits, the
    16-bit ``out`` too; the one-element row builds no kernel of its own (dynamo specialises size 1)."""
    gen = torch.Generator().manual_seed(2)
    whole = [torch.randn(65, generator=gen), torch.rand(65, generator=gen), torch.rand(65, generator=gen)]
    chunked = [tensor.clone() for tensor in whole]
    grad = torch.randn(65, generator=gen).bfloat16()
    outs = torch.zeros(65, dtype=torch.bfloat16), torch.zeros(65, dtype=torch.bfloat16)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01, "eps": 1e-8, "decoupled_weight_decay": True}
    scalars = compiled_adam.scalars(group, 2, 0.5)
    with torch.no_grad():
        compiled_adam.step(whole[0], grad, whole[1], whole[2], scalars, outs[0])
        compiled_adam.step(chunked[0][:64], grad[:64], chunked[1][:64], chunked[2][:64], scalars, outs[1][:64])
        graphs = counters["stats"]["unique_graphs"]
        compiled_adam.step(chunked[0][64:], grad[64:], chunked[1][64:], chunked[2][64:], scalars, outs[1][64:])
    assert counters["stats"]["unique_graphs"] == graphs
    for a, b in zip(whole + [outs[0]], chunked + [outs[1]]):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0], torch.zeros(65, dtype=torch.bfloat16))


def test_the_estimate_counts_16_bit_host_gradient_buffers():
    config = {"stage": 3, "bf16": {"enabled": True}, "offload_optimizer": {"device": "cpu"}}
    fused = placement_bytes(estimate_stage(10_000, config, 4), config)
    config["offload_optimizer"]["host_kernel"] = "compiled"
    compiled = placement_bytes(estimate_stage(10_000, config, 4), config)
    assert fused.host == 2500 * (4 + 8 + 4)  # master, Adam's moments, the fp32 gradient buffer
    assert compiled.host == 2500 * (4 + 8 + 2)  # the gradient buffer in bf16
    assert compiled.accelerator == fused.accelerator


def train(rank: int, config: dict, overlap: bool) -> dict:
    model = build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    engine._offload.overlap = overlap
    graphs = counters["stats"]["unique_graphs"]  # what dynamo built so far (the kernel: at setup)
    losses = []
    for step in range(STEPS):
        loss = engine.module(*make_batch(MODEL, rank, step, 0, dtype=torch.float16 if "fp16" in config
                                         else torch.bfloat16))
        engine.backward(loss)
        engine.step()
        scheduler.step()
        losses.append(loss.float().item())
    offload = engine._offload
    result = {"losses": losses, "params": full_params(engine.module),
              "masters": engine.full_state_dict(rank0_only=False), "chunks": offload.chunks_stepped,
              "overlapped": offload.overlapped.overlapped_steps, "early": offload.overlapped.parts_stepped_in_backward,
              "grad_dtypes": sorted({str(buffer.dtype) for buffer in offload.grads.buffers.values()}),
              "built_in_training": counters["stats"]["unique_graphs"] - graphs}
    engine.close()
    return result


BF16 = {"bf16": {"enabled": True}}
# fp16: a fixed loss scale of 2^8 (finite gradients for this model), which the compiled kernel takes off as it reads
CASES = {"stage 2": {"stage": 2, **BF16}, "stage 3": {"stage": 3, **BF16},
         "stage 3, offload_param cpu": {"stage": 3, "offload_param": {"device": "cpu"}, **BF16},
         "stage 3, fp16": {"stage": 3, "fp16": {"enabled": True, "loss_scale": 256.0}}}


def kernels_worker(rank, world_size):
    out = {}
    fused, compiled = {"device": "cpu"}, {"device": "cpu", "host_kernel": "compiled"}
    for label, case in CASES.items():
        config = {**SMALL, **case, "gradient_clipping": 0.5}
        out[label] = {"fused": train(rank, {**config, "offload_optimizer": fused}, overlap=False),
                      "compiled": train(rank, {**config, "offload_optimizer": compiled}, overlap=False),
                      "overlapped": train(rank, {**config, "offload_optimizer": compiled}, overlap=True)}
    for stage in (2, 3):  # each part's step started during backward (no clipping: that needs every gradient)
        config = {**SMALL, "stage": stage, **BF16}
        out[f"stage {stage}, early start"] = {
            "compiled": train(rank, {**config, "offload_optimizer": compiled}, overlap=False),
            "early": train(rank, {**config, "offload_optimizer": {**compiled, "overlap_with_backward": True}},
                           overlap=True)}
    # Two torch threads: the step's thread runs one (step_thread.py), and dynamo guards on the count, so setup
    # built the kernel for both; a step that built it again would take a compile's time (tens of seconds).
    torch.set_num_threads(2)
    config = {**SMALL, "stage": 3, **BF16}
    out["stage 3, two threads"] = {"compiled": train(rank, {**config, "offload_optimizer": compiled}, overlap=False),
                                   "overlapped": train(rank, {**config, "offload_optimizer": compiled}, overlap=True)}
    torch.set_num_threads(1)
    return out


def same(label: str, a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"], label
    for key in ("params", "masters"):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{label}: {key} {name} differs"


def test_the_compiled_kernel_trains_as_the_fused_one_and_overlaps_bit_for_bit():
    for rank, out in enumerate(run_distributed(kernels_worker, 2, timeout=400)):
        for case, runs in out.items():
            label = f"rank {rank}, {case}"
            for name, run in runs.items():  # setup built every kernel the steps ran, on either thread
                assert run["built_in_training"] == 0, (label, name, run["built_in_training"])
            if "two threads" in case:
                assert runs["overlapped"]["overlapped"] == STEPS - 1, (label, runs["overlapped"]["overlapped"])
                same(label, runs["compiled"], runs["overlapped"])
                continue
            if "early" in runs:  # started during backward: bit for bit the inline compiled step
                assert runs["early"]["early"] > 0 and runs["compiled"]["early"] == 0, (label, runs["early"]["early"])
                same(label, runs["compiled"], runs["early"])
                continue
            fused, compiled, overlapped = runs["fused"], runs["compiled"], runs["overlapped"]
            assert fused["chunks"] == 0 and compiled["chunks"] > 0, (label, fused["chunks"], compiled["chunks"])
            assert overlapped["overlapped"] == STEPS - 1, (label, overlapped["overlapped"])
            # host gradient buffers: fp32 for the fused kernel (the 16-bit shards copied and cast); none or 16-bit
            # for the compiled one (it reads the shards in place; the overlapped step copies them, uncast)
            half = "torch.float16" if "fp16" in case else "torch.bfloat16"
            assert fused["grad_dtypes"] == ["torch.float32"], (label, fused["grad_dtypes"])
            assert compiled["grad_dtypes"] in ([], [half]), (label, compiled["grad_dtypes"])
            assert overlapped["grad_dtypes"] == [half], (label, overlapped["grad_dtypes"])
            same(label, compiled, overlapped)  # written by the kernel itself / copied by the thread's write-back
            start = build_model(MODEL).state_dict()
            moved = 0.0
            for name, value in fused["masters"].items():
                # the kernels round differently (~1e-9 a step); an update is ~1e-3 (AdamW, lr 1e-3)
                gap = (value.float() - compiled["masters"][name].float()).abs().max().item()
                assert gap < 1e-5, (label, name, gap)
                if name in start:
                    moved = max(moved, (value.float() - start[name].float()).abs().max().item())
            assert moved > 1e-4, (label, moved)  # the reference trained
            assert max(abs(a - b) for a, b in zip(fused["losses"], compiled["losses"])) < 1e-2, label


def refusals_worker(rank, world_size):
    out = {}
    compiled = {"device": "cpu", "host_kernel": "compiled"}
    for name, block in (("nvme", {**compiled, "device": "nvme", "nvme_path": "/tmp"}),
                        ("delayed", {**compiled, "delayed_update_after": 1})):
        try:
            zero_core.setup(build_model(MODEL), make_optimizer(build_model(MODEL)),
                            {**SMALL, "stage": 2, "offload_optimizer": block})
        except ZeroConfigError as error:
            out[name] = str(error)
    for name, make in (("sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
                       ("amsgrad", lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True))):
        model = build_model(MODEL)
        engine = zero_core.setup(model, make(model), {**SMALL, "stage": 3, "offload_optimizer": compiled})
        engine.backward(engine.module(*make_batch(MODEL, rank, 0, 0)))
        try:
            engine.step()
        except ValueError as error:
            out[name] = str(error)
        engine.close()
    found = compiled_adam.compiler
    compiled_adam.compiler = lambda: None
    model = build_model(MODEL)
    try:
        zero_core.setup(model, make_optimizer(model), {**SMALL, "stage": 2, "offload_optimizer": compiled})
    except RuntimeError as error:
        out["no compiler"] = str(error)
    finally:
        compiled_adam.compiler = found
    return out


def test_what_the_compiled_kernel_cannot_step_is_refused_with_the_field_named():
    (out,) = run_distributed(refusals_worker, 1, timeout=200)
    assert "host_kernel" in out.get("nvme", "") and "device 'cpu'" in out["nvme"], out.get("nvme")
    assert "delayed_update_after" in out.get("delayed", ""), out.get("delayed")
    assert FIELD in out.get("sgd", "") and "SGD" in out["sgd"], out.get("sgd")
    assert FIELD in out.get("amsgrad", "") and "amsgrad" in out["amsgrad"], out.get("amsgrad")
    assert FIELD in out.get("no compiler", "") and "C++ compiler" in out["no compiler"], out.get("no compiler")


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
