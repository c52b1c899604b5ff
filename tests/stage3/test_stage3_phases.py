"""Stage 3's phase (zero_core/stage3/phase.py), frozen policy, and the reduction queue shared with stage 2.

The phase sequence of a real engine at world size 1 through the situations a training loop creates (gradient
accumulation under no_sync, an eval forward under no_grad before and after a step), checked against the phases the docs state; a transition no step makes
raises naming both phases; the policy cannot be changed after setup; the queue keeps at most ``depth``
reductions in flight with overlap and none without.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import zero_core
from distributed import run_distributed
from zero_core.reduction import BackwardSession, ReductionQueue
from zero_core.stage3.phase import Phase, checked


def test_a_transition_no_step_makes_names_both_phases():
    with pytest.raises(RuntimeError, match="from phase 'idle' to 'stepped'"):
        checked(Phase.IDLE, Phase.STEPPED)
    assert checked(Phase.BACKWARD, Phase.FORWARD) is Phase.FORWARD


def test_queue_keeps_depth_in_flight_only_with_overlap():
    done = []
    queue = ReductionQueue(done.append, depth=2, overlap=True)
    for job in range(4):
        queue.push(job)
    assert done == [0, 1] and len(queue) == 2  # oldest first, two still in flight
    queue.drain()
    assert done == [0, 1, 2, 3] and len(queue) == 0
    eager = ReductionQueue(done.append, depth=2, overlap=False)
    eager.push(4)
    assert done[-1] == 4 and len(eager) == 0


def test_session_under_no_sync_keeps_gradients_waiting():
    session = BackwardSession(on_end=lambda: None)
    session.sync = False
    assert session.grad_arrived() is False and session.unsynced_grads and not session.open


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean()


def _phases(rank, world_size):
    torch.manual_seed(0)
    model = _Blocks()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1),
                             {"stage": 3, "param_persistence_threshold": 0})
    runtime = engine.runtime
    x = torch.randn(4, 8)
    seen = {"setup": runtime.phase.value}
    for step in range(2):  # the first step records the trace, the second follows it
        with engine.no_sync():
            engine.backward(engine.module(x))  # accumulation: the gradients wait in param.grad
        seen[f"{step} after no_sync backward"] = runtime.phase.value
        loss = engine.module(x)
        seen[f"{step} after forward"] = runtime.phase.value
        engine.backward(loss)
        seen[f"{step} after backward"] = runtime.phase.value
        with torch.no_grad():
            engine.module(x)  # an eval forward between backward and step
        engine.step()
        seen[f"{step} after step"] = runtime.phase.value
    with torch.no_grad():
        engine.module(x)  # an eval forward after the step: it ends the trace's step
    seen["eval after step"] = runtime.phase.value
    try:
        runtime._to(Phase.IDLE)  # FORWARD -> IDLE: no training step does this
    except RuntimeError as error:
        seen["wrong transition"] = str(error)
    policy_frozen = False
    try:
        runtime.policy.max_live_parameters = 1
    except dataclasses.FrozenInstanceError:
        policy_frozen = True
    seen["policy frozen"] = policy_frozen
    return seen


def test_phases_of_a_training_loop():
    seen = run_distributed(_phases, 1, timeout=120)[0]
    for step in range(2):
        assert seen[f"{step} after no_sync backward"] == "forward", seen
        assert seen[f"{step} after forward"] == "forward", seen
        assert seen[f"{step} after backward"] == "forward", seen
        assert seen[f"{step} after step"] == "stepped", seen
    assert seen["setup"] == "idle"
    assert seen["eval after step"] == "forward", seen
    assert "from phase 'forward' to 'idle'" in seen["wrong transition"], seen
    assert seen["policy frozen"] is True
