"""A forward installed on the model instance survives ``ZeroAccelerator`` in every mode (one launch, 2 ranks).

tests/accelerate/scripts/patched_forward.py patches a tiny model's forward as TRL's fused LM head does and
trains it under plain Accelerate DDP and under ``ZeroAccelerator`` (stages 2 and 3, Accelerate-style autocast,
the engine's bf16, fp32, compiled by ``dynamo_backend``), patched before or after ``prepare``. Before the fix,
``prepare`` under autocast left the class's forward on the model (no autocast, no patch): TRL then failed with
"'CausalLMOutputWithPast' object has no attribute 'log_probs'".
"""

import json

import pytest

from accelerate_runs import accelerate_launch, clean_env, max_diff

TOLERANCE = 1e-5
AUTOCAST_PAIRS = [("zero2_autocast", "ddp_autocast"), ("zero3_autocast", "ddp_autocast"),
                  ("zero3_autocast_after", "ddp_autocast_after"), ("zero3_fp32_after", "ddp_fp32"),
                  ("zero3_autocast_compiled", "ddp_autocast_compiled")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("patched_forward")
    accelerate_launch(tmp, "patched_forward.py", tmp / "out.json", env=clean_env())
    return json.loads((tmp / "out.json").read_text())


def test_every_forward_is_the_patched_one(runs):
    assert all(all(run["fused"]) for run in runs.values()), {k: v["fused"] for k, v in runs.items()}


@pytest.mark.parametrize("zero,ddp", AUTOCAST_PAIRS)
def test_runs_under_autocast_exactly_when_ddp_does_and_ends_at_its_weights(runs, zero, ddp):
    assert runs[zero]["autocast"] == runs[ddp]["autocast"]
    assert max_diff(runs[zero]["weights"], runs[ddp]["weights"]) <= TOLERANCE


def test_autocast_is_on_in_the_forward_when_patched_before_prepare(runs):
    assert all(runs["zero2_autocast"]["autocast"]) and all(runs["ddp_autocast"]["autocast"])
    assert not any(runs["zero3_bf16"]["autocast"])  # the engine's bf16 casts the weights instead


def test_the_engines_bf16_trains_the_patched_model_close_to_ddps_autocast(runs):
    assert 0 < max_diff(runs["zero3_bf16"]["weights"], runs["ddp_autocast"]["weights"]) <= 2e-2


@pytest.mark.parametrize("name", ["zero2_autocast", "zero3_autocast", "zero3_autocast_after", "zero3_bf16",
                                  "zero3_fp32_after"])
def test_unwrap_model_without_the_fp32_wrapper_keeps_the_patch(runs, name):
    assert runs[name]["unwrapped_is_patch"]
