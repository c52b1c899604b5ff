"""Gradients give their memory back between steps (zero_core/grad_memory.py; on CUDA by default, forced on
here on the CPU): stage 1's full buffer and the gradient shards of stages 2 and 3. Stages 1-3 still train to
DDP's weights, with accumulation (no_sync and synced micro-batches) and clipping; after a step the gradients
hold no memory, a backward allocates them again, and reading them between steps gives zeros, not a failure. They
hold none after setup either (the first reduction allocates them)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import zero_core
from reference import train_ddp
from stage3_support import batch, build, max_abs_diff, run_once, train_engine
from zero_core import grad_memory

STEPS, ACCUMULATION, MAX_NORM = 4, 2, 0.5
CONFIGS = {
    "stage1": {"stage": 1, "reduce_bucket_size": 100},
    "stage2": {"stage": 2, "reduce_bucket_size": 100},
    "stage3": {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 100},
}


def _held_bytes(engine) -> int:
    """Gradient memory held now, as memory_stats() counts it (the call restores nothing)."""
    return engine.memory_stats()["grads"]


def _worker(rank: int, world_size: int) -> dict:
    grad_memory.RELEASE_ON_CPU = True  # this process only
    model_fn, data_fn = partial(build, "transformer"), partial(batch, "transformer")
    reference = train_ddp(model_fn, data_fn, STEPS, ACCUMULATION, MAX_NORM)
    out = {}
    for name, config in CONFIGS.items():
        model = model_fn()
        fresh = zero_core.setup(model, torch.optim.AdamW(model.parameters()), config)
        held_after_setup = _held_bytes(fresh)  # born released, allocated by the first reduction
        fresh.close()
        result, engine = train_engine(model_fn, data_fn, config, STEPS, ACCUMULATION, MAX_NORM)
        released_after_step = _held_bytes(engine)
        zero_between_steps = all(not s.any() for part in engine.runtime.parts for s in part.grad_shards())
        engine.backward(engine.module(*data_fn(rank, 0, 0)))
        out[name] = {
            "max_dw": max_abs_diff(result.params, reference.params),
            "losses": (result.losses, reference.losses),
            "norms": (result.norms, reference.norms),
            "held_after_step": released_after_step,
            "held_after_backward": _held_bytes(engine),
            "zero_between_steps": zero_between_steps,
            "held_after_setup": held_after_setup,
        }
    return out


@pytest.mark.timeout(300)
def test_released_gradient_shards_train_like_ddp():
    for rank, result in enumerate(run_once(_worker, 2, timeout=240)):
        for name, r in result.items():
            assert r["max_dw"] <= 1e-5, (rank, name, r["max_dw"])
            assert torch.allclose(torch.tensor(r["losses"][0]), torch.tensor(r["losses"][1]), rtol=1e-5), (name, r)
            assert torch.allclose(torch.tensor(r["norms"][0]), torch.tensor(r["norms"][1]), rtol=1e-4), (name, r)
            assert r["held_after_step"] == 0, (name, r)  # the memory went back
            assert r["held_after_backward"] > 0, (name, r)  # and came back for the reduction
            assert r["zero_between_steps"], (name, r)  # read between steps: zeros, not a failure
            assert r["held_after_setup"] == 0, (name, r)
