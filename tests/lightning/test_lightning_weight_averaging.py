"""Lightning's EMAWeightAveraging under ZeroStrategy against DDP, and the engine's own average at stage 3
(lightning/scripts/weight_averaging.py runs them all in one 2-process launch)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("weight_averaging")
    run("weight_averaging.py", str(path), timeout=280)
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_ema_callback_gives_ddps_average_at_stages_1_and_2(out, name):
    results = load_json(out, "weight_averaging")
    assert abs(results[name] - results["ddp"]) <= TOLERANCE  # validation ran on the average
    for rank in (0, 1):
        weights = load_rank(out, name, rank)
        assert max_diff(load_rank(out, "ddp", rank), weights) <= TOLERANCE  # the average, after fit
        assert weights["_masters_off"].item() <= TOLERANCE  # in the masters too


def test_ema_callback_resumes_from_a_sharded_checkpoint_as_under_ddp(out):
    results = load_json(out, "weight_averaging")
    assert abs(results["zero2_resumed"] - results["ddp_resumed"]) <= TOLERANCE
    for rank in (0, 1):
        assert max_diff(load_rank(out, "ddp_resumed", rank), load_rank(out, "zero2_resumed", rank)) <= TOLERANCE


def test_ema_callback_leaves_its_average_in_the_16_bit_masters(out):
    for rank in (0, 1):  # bf16: the masters are not the parameters' storage; the strategy copies the average in
        assert load_rank(out, "zero2_bf16", rank)["_masters_off"].item() == 0.0


def test_ema_callback_at_stage_3_names_the_engine_average(out):
    message = load_json(out, "weight_averaging")["zero3_callback"]
    assert message.startswith("ValueError: EMAWeightAveraging cannot work under ZeroStrategy(stage=3)"), message
    assert "weights_ema_decay" in message and "SwapInWeightsEMA" in message


def test_engine_average_validates_like_ddps_callback_at_stage_3(out):
    results = load_json(out, "weight_averaging")
    assert abs(results["zero3_engine"] - results["ddp"]) <= TOLERANCE
    for rank in (0, 1):
        reference = {k: v for k, v in load_rank(out, "ddp", rank).items() if not k.startswith("_")}
        assert max_diff(reference, load_rank(out, "zero3_engine", rank)) <= TOLERANCE
