"""On a GPU (one process): a forward patched on the instance that reads the head's weight directly trains under
stage 3 as the plain model does (the head gathered when read, on the side streams; compiled too), and under ``ZeroAccelerator``
with Accelerate-style bf16 autocast the patch runs under autocast, as under plain Accelerate."""

from __future__ import annotations

import sys
from pathlib import Path
from types import MethodType

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stage3"))  # tests/stage3, for fused_forward

from test_stage3_read_in_forward import fused_forward  # noqa: E402
from tiny_lm import TinyLM  # noqa: E402

STAGE3 = {"stage": 3, "param_persistence_threshold": 0, "max_live_parameters": 100}
STEPS = 4


def _group() -> None:
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _batch(step: int, device):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 19, (3, 6), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _patched(device: str) -> TinyLM:
    model = TinyLM().to(device)
    model.forward = MethodType(fused_forward, model)
    return model


def stage3_against_plain(device: str, compiled: bool = False) -> tuple:
    """(max weight difference to the plain model, whether the head is released after the last step). Compiled
    (aot_eager: seconds), the head is read in a graph after the break at the blocks' hooks and gathered first
    ([Note: compiled reads] in zero_core/stage3/partitioned_param.py)."""
    import zero_core
    from zero_core.stage3.partitioned_param import is_released

    _group()
    torch._dynamo.reset()
    plain, model = _patched(device), _patched(device)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), STAGE3)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    for step in range(STEPS):
        plain(*_batch(step, device)).backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.backward(run(*_batch(step, device)))
        engine.step()
    released = is_released(model.lm_head.weight)
    with zero_core.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    engine.close()
    return diff, released


def autocast_seen_in_patch(cpu: bool) -> tuple:
    """Whether each forward of a patched model under ZeroAccelerator's bf16 autocast ran under autocast; device."""
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_zero import ZeroAccelerator, ZeroPlugin

    _group()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = ZeroAccelerator(mixed_precision="bf16", cpu=cpu,
                                  zero_plugin=ZeroPlugin(config=STAGE3, autocast=True))
    model = TinyLM()
    seen = []

    def fused(self, tokens, targets):
        seen.append(torch.is_autocast_enabled(accelerator.device.type))
        return fused_forward(self, tokens, targets)

    model.forward = MethodType(fused, model)
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        accelerator.backward(prepared(*_batch(step, accelerator.device)))
        optimizer.step()
        optimizer.zero_grad()
    return seen, accelerator.device.type


@pytest.mark.cuda
def test_stage3_gathers_a_head_read_in_a_patched_forward_on_the_gpu():
    diff, released = stage3_against_plain("cuda")
    assert diff <= 1e-5 and released


@pytest.mark.cuda
def test_compiled_stage3_gathers_a_head_read_after_a_helper_method_on_the_gpu():
    diff, released = stage3_against_plain("cuda", compiled=True)
    assert diff <= 1e-5 and released


@pytest.mark.cuda
def test_a_patched_forward_runs_under_autocast_with_zero_accelerator_on_the_gpu():
    assert autocast_seen_in_patch(cpu=False) == ([True, True], "cuda")
