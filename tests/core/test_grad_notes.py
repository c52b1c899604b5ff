"""The engine's record of which parameters got a gradient (zero_core/grad_notes.py): builtin hooks that append to
a list, read when the engine needs them. What the Python note per gradient did must still hold: a gradient that
arrives after the step's gradients were reduced raises in its own backward (at every stage), the hooks go back to
the cheap ones after the step, and a model dropped between its backward and its step is freed."""

from __future__ import annotations

import gc
import weakref

import torch

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer

STAGES = {1: {"stage": 1}, 2: {"stage": 2}, 3: {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _late_backward(rank: int, world_size: int) -> dict:
    out = {}
    for stage, config in STAGES.items():
        model = build_model("mlp")
        engine = zero_core.setup(model, make_optimizer(model), {"zero_optimization": config})
        engine.backward(engine.module(*make_batch("mlp", rank, 0, 0)))
        engine.clip_grad_norm_(1.0)  # reduces the gradients
        armed = engine._notes.armed
        try:
            engine.backward(engine.module(*make_batch("mlp", rank, 0, 1)))
            error = ""
        except RuntimeError as caught:
            error = str(caught)
        engine.zero_grad()
        # the next step trains as usual, on the cheap hooks again
        engine.backward(engine.module(*make_batch("mlp", rank, 1, 0)))
        engine.step()
        out[stage] = {"armed": armed, "error": error, "armed_after": engine._notes.armed,
                      "notes_left": len(engine._notes.arrivals)}
    return out


def test_a_gradient_after_the_reduction_raises_in_its_backward():
    for result in run_distributed(_late_backward, 2, timeout=120):
        for stage, r in result.items():
            assert r["armed"] and not r["armed_after"] and r["notes_left"] == 0, (stage, r)
            assert "after this step's gradients were already reduced" in r["error"], (stage, r)


def _dropped_mid_step(rank: int, world_size: int) -> dict:
    alive = {}
    for stage, config in STAGES.items():
        model = build_model("mlp")
        engine = zero_core.setup(model, make_optimizer(model), {"zero_optimization": config})
        engine.backward(engine.module(*make_batch("mlp", rank, 0, 0)))  # noted, not yet read by a step
        refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(next(model.parameters()))]
        del model, engine
        gc.collect()
        alive[stage] = [ref() is not None for ref in refs]
    return alive


def test_a_model_dropped_between_backward_and_step_is_freed():
    for alive in run_distributed(_dropped_mid_step, 2, timeout=120):
        assert alive == {stage: [False, False, False] for stage in STAGES}, alive
