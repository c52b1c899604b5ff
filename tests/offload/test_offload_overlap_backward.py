"""Each unit's offloaded step started during backward (``offload_optimizer.overlap_with_backward``;
offload/overlapped_step.py, ``start_early``).

Two ranks at stage 3 (fp32, bf16, persistent units, ``offload_param: cpu``) and at stage 2 (fp32, bf16: each
reduce bucket started on its own) train the same steps twice in one process: with the overlap forced on (it acts
only beside an accelerator) and inline. No clipping (the early start refuses it), an LR scheduler stepped after
every ``step()``, AdamW with full partitioning. Every loss, every final parameter and every master is bit for bit
the inline run's; parts' steps did start during backward, before the step call (after the first two steps: the
first makes the state, the second names the parts), and the next forward waited for them. Then, on one rank at
stages 2 and 3, what the early start cannot make exact is refused (stage 1 at setup): clipping in the config, a
clip between backward and step (it turns the early start off for the run, with a warning, and the result is the
inline clipped run's), zero_grad instead of step() after a backward that started units, a second reducing
backward before the step, and a read of the masters between backward and step() (the step() after it still
steps each unit once: the inline run's weights)."""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, make_scheduler
from stage3_support import full_params

from zero_core.config import ZeroConfigError
from zero_core.offload import overlapped_step

MODEL = "transformer"
STEPS = 5
SMALL = {"stage": 3, "reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
RUNS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
        "persistent units": {"param_persistence_threshold": 200},
        "offload_param cpu": {"offload_param": {"device": "cpu"}},
        "stage 2": {"stage": 2}, "stage 2, bf16": {"stage": 2, "bf16": {"enabled": True}}}


def train(rank: int, config: dict, overlap: bool, clip: float = 0.0) -> dict:
    model = build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    engine._offload.overlap = True if overlap else False
    dtype = torch.bfloat16 if "bf16" in config else torch.float32
    overlapped = engine._offload.overlapped
    losses, in_backward, counted = [], 0, 0  # parts started before a step call (stage 2's last bucket: inside it)
    for step in range(STEPS):
        loss = engine.module(*make_batch(MODEL, rank, step, 0, dtype=dtype))
        engine.backward(loss)
        if clip:
            engine.clip_grad_norm_(clip)
        in_backward += overlapped.parts_stepped_in_backward - counted
        engine.step()
        counted = overlapped.parts_stepped_in_backward
        scheduler.step()
        losses.append(loss.float().item())
    result = {"losses": losses, "params": full_params(engine.module),
              "masters": engine.full_state_dict(rank0_only=False), "in_backward": in_backward,
              "early": overlapped.parts_stepped_in_backward, "overlapped": overlapped.overlapped_steps,
              "master_numel": sum(master.numel() for master in engine._offload.all_masters())}
    engine.close()
    # the last step's parts on the thread, as benchmarks/gpu_offload.py reports them (close waited for them)
    timeline = overlapped.timeline
    result["timeline"] = [(t.early, t.numel, t.taken <= t.arrived <= t.stepped <= t.written) for t in timeline]
    result["first_taken_before_call"] = bool(timeline) and timeline[0].taken < overlapped.step_called_at
    return result


def equivalence_worker(rank, world_size):
    waits = []
    wait = overlapped_step.UpdateInFlight.wait
    step_part = overlapped_step.OverlappedStep._step_part

    def counted_wait(handle):
        waits.append(handle.ready())
        wait(handle)

    def slow_parts(self, *args):  # the thread lags backward and the forward, so a stale read would show
        time.sleep(0.02)
        step_part(self, *args)

    overlapped_step.UpdateInFlight.wait = counted_wait
    overlapped_step.OverlappedStep._step_part = slow_parts
    results = {}
    for label, run in RUNS.items():
        config = {**SMALL, **run, "offload_optimizer": {"device": "cpu", "overlap_with_backward": True}}
        inline = train(rank, {**config, "offload_optimizer": {"device": "cpu"}}, overlap=False)
        waits.clear()
        early = train(rank, config, overlap=True)
        early["waits"] = list(waits)
        results[label] = (inline, early)
    return results


def test_steps_started_during_backward_equal_the_inline_step_bit_for_bit():
    for rank, results in enumerate(run_distributed(equivalence_worker, 2, timeout=300)):
        for label, (inline, early) in results.items():
            where = f"rank {rank}, {label}"
            assert inline["losses"] == early["losses"], (where, inline["losses"], early["losses"])
            for key in ("params", "masters"):
                for name, value in inline[key].items():
                    assert torch.equal(value, early[key][name]), f"{where}: {key} {name} differs"
            assert inline["early"] == 0 and inline["overlapped"] == 0, where
            assert early["overlapped"] == STEPS - 1, f"{where}: {early['overlapped']} overlapped steps"
            # steps 3-5 start units in backward (step 1 makes the state, step 2 names the step's parts)
            assert early["in_backward"] >= 3, f"{where}: {early['in_backward']} parts started during backward"
            assert False in early["waits"], f"{where}: no forward waited on the host for a unit's update"
            timeline = early["timeline"]  # the last step's: every unit once, in time order, the first in backward
            assert all(ordered for _, _, ordered in timeline), (where, timeline)
            assert sum(numel for _, numel, _ in timeline) == early["master_numel"], (where, timeline)
            assert any(was_early for was_early, _, _ in timeline) and early["first_taken_before_call"], where
            start = build_model(MODEL).state_dict()
            assert any(not torch.equal(v.float(), start[n].float()) for n, v in inline["params"].items()
                       if n in start), f"{where}: the reference run did not train"


def refusals_worker(rank, world_size, stage):
    config = {**SMALL, "stage": stage, "offload_optimizer": {"device": "cpu", "overlap_with_backward": True}}
    out = {}
    try:
        zero_core.setup(build_model(MODEL), make_optimizer(build_model(MODEL)), {**config, "gradient_clipping": 1.0})
    except ZeroConfigError as error:
        out["config"] = str(error)
    try:
        zero_core.setup(build_model(MODEL), make_optimizer(build_model(MODEL)), {**config, "stage": 1})
    except ZeroConfigError as error:
        out["config_stage_1"] = str(error)
    # a clip between backward and step: the early start turns itself off, and the run is the inline one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipped = train(rank, config, overlap=True, clip=0.05)
    out["clip_warning"] = [str(w.message) for w in caught if "overlap_with_backward" in str(w.message)]
    out["clipped"] = clipped
    out["inline_clipped"] = train(rank, {**config, "offload_optimizer": {"device": "cpu"}}, overlap=False, clip=0.05)

    def engine_after_two_steps():
        model = build_model(MODEL)
        engine = zero_core.setup(model, make_optimizer(model), config)
        engine._offload.overlap = True
        for step in range(2):
            engine.backward(engine.module(*make_batch(MODEL, rank, step, 0)))
            engine.step()
        engine.backward(engine.module(*make_batch(MODEL, rank, 2, 0)))  # units start their step here
        return engine

    engine = engine_after_two_steps()
    out["started"] = engine._offload.overlapped.started_in_backward()
    try:
        engine.zero_grad()
    except RuntimeError as error:
        out["zero_grad"] = str(error)
    engine.close()
    engine = engine_after_two_steps()
    try:
        engine.backward(engine.module(*make_batch(MODEL, rank, 3, 0)))
    except RuntimeError as error:
        out["second_backward"] = str(error)
    engine.close()
    # a reader between backward and step() is refused; the step() after it completes the step, once
    engine = engine_after_two_steps()
    try:
        engine.full_state_dict(rank0_only=False)
    except RuntimeError as error:
        out["read_between"] = str(error)
    engine.step()
    out["after_refused_read"] = full_params(engine.module)
    engine.close()
    engine = engine_after_two_steps()  # a refused read, then a second backward: its units were stepped already
    try:
        engine.full_state_dict(rank0_only=False)
    except RuntimeError:
        pass
    try:
        engine.backward(engine.module(*make_batch(MODEL, rank, 3, 0)))
    except RuntimeError as error:
        out["backward_after_read"] = str(error)
    engine.close()
    model = build_model(MODEL)
    inline = zero_core.setup(model, make_optimizer(model), {**config, "offload_optimizer": {"device": "cpu"}})
    for step in range(3):
        inline.backward(inline.module(*make_batch(MODEL, rank, step, 0)))
        inline.step()
    out["inline_three_steps"] = full_params(inline.module)
    inline.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_what_the_early_start_cannot_make_exact_is_refused_or_turns_it_off(stage):
    (out,) = run_distributed(functools.partial(refusals_worker, stage=stage), 1, timeout=200)
    assert "overlap_with_backward" in out["config"] and "gradient_clipping" in out["config"], out["config"]
    assert "needs stage 2 or 3" in out.get("config_stage_1", ""), out.get("config_stage_1")
    assert out["clip_warning"] and "clipped" in out["clip_warning"][0], out["clip_warning"]
    assert out["clipped"]["early"] == 0, out["clipped"]["early"]
    assert out["clipped"]["losses"] == out["inline_clipped"]["losses"]
    for name, value in out["inline_clipped"]["params"].items():
        assert torch.equal(value, out["clipped"]["params"][name]), name
    assert out["started"] > 0, out["started"]
    assert "zero_grad" in out and "without step()" in out["zero_grad"], out.get("zero_grad")
    assert "second_backward" in out and "already started" in out["second_backward"], out.get("second_backward")
    assert "already started" in out.get("backward_after_read", ""), out.get("backward_after_read")
    assert "read_between" in out and "partly updated" in out["read_between"], out.get("read_between")
    for name, value in out["inline_three_steps"].items():
        assert torch.equal(value, out["after_refused_read"][name]), name


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
