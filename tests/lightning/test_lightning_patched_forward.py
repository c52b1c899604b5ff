"""A forward patched on the model instance (TRL's fused LM head reads ``lm_head.weight`` directly) trains under
``ZeroStrategy`` stage 3 as under DDP, patched before ``fit`` or after the engine is set up, in 32-true and
bf16-mixed; the patch stays on the model (lightning/scripts/patched_forward.py, one 2-process launch)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

# 32-true: float reordering only. bf16-mixed: ZeroStrategy trains bf16 parameters with fp32 masters (DeepSpeed's
# meaning, docs/lightning.md), DDP fp32 parameters under autocast, so only bf16 rounding apart after 6 Adam steps.
TOLERANCE = {"32-true": 1e-5, "bf16-mixed": 5e-2}
PRECISIONS = tuple(TOLERANCE)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("patched_forward")
    run("patched_forward.py", str(path), timeout=200)
    return path


@pytest.mark.timeout(250)
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_patched_forward_runs_every_step_and_trains_to_ddps_weights(out, precision, when):
    results = load_json(out, "patched_forward")
    ddp, zero = results[f"ddp_{precision}"], results[f"zero3_{precision}_{when}"]
    assert zero["steps"] == ddp["steps"] > 0 and zero["calls"] == zero["steps"] == ddp["calls"]
    assert zero["still_patched"] and ddp["still_patched"]
    reference = load_rank(out, f"ddp_{precision}")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"zero3_{precision}_{when}", rank)) <= TOLERANCE[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_patching_before_fit_or_after_setup_trains_the_same(out, precision):
    before, after = load_rank(out, f"zero3_{precision}_before"), load_rank(out, f"zero3_{precision}_after")
    assert max_diff(before, after) <= 1e-6
