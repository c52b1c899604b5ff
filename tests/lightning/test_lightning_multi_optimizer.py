"""Real 2-process Trainer runs: several optimizers (a GAN under manual optimization) and a second fit of the same
module, each against DDP (lightning/scripts/multi_optimizer.py runs them all in one launch)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5  # float reordering only


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi_optimizer")
    run("multi_optimizer.py", str(path), timeout=200)
    return path


@pytest.mark.timeout(220)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_gan_with_two_optimizers_matches_ddp(out, stage):
    reference = load_rank(out, "gan_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"gan_{stage}", rank)) <= WEIGHT_TOLERANCE
    results = load_json(out, "gan")
    ddp, zero = results["ddp"], results[stage]
    assert zero["optimizers"] == ["ZeroOptimizer", "ZeroOptimizer"]
    assert zero["global_step"] == ddp["global_step"] == 16  # 2 epochs x 4 batches x 2 optimizers
    assert zero["lrs"] == pytest.approx(ddp["lrs"])  # each scheduler stepped its own optimizer
    for key, value in ddp["metrics"].items():
        assert zero["metrics"][key] == pytest.approx(value, abs=1e-5), key


def test_gan_resumes_from_its_checkpoint_and_from_the_converted_file_in_ddp_and_zero(out):
    reference = load_rank(out, "gan_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, "gan_zero3_resumed", rank)) <= WEIGHT_TOLERANCE
        assert max_diff(reference, load_rank(out, "gan_ddp_from_converted", rank)) <= WEIGHT_TOLERANCE
        assert max_diff(reference, load_rank(out, "gan_zero2_from_converted", rank)) <= WEIGHT_TOLERANCE
    resumed = load_json(out, "gan")["resumed"]
    assert resumed["converted_optimizers"] == 2
    assert resumed["zero3"]["lrs"] == pytest.approx(load_json(out, "gan")["ddp"]["lrs"])
    assert resumed["ddp"]["global_step"] == resumed["zero3"]["global_step"] == 16


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_second_fit_of_the_same_module_matches_ddp(out, stage):
    for which in ("first", "second"):
        reference = load_rank(out, f"refit_ddp_{which}")
        for rank in (0, 1):
            assert max_diff(reference, load_rank(out, f"refit_{stage}_{which}", rank)) <= WEIGHT_TOLERANCE
    assert max_diff(load_rank(out, "refit_ddp_first"), load_rank(out, "refit_ddp_second")) > 1e-3  # it trained on
    refit = load_json(out, "refit")
    assert refit[stage]["global_steps"] == refit["ddp"]["global_steps"]
    assert refit[stage]["lr"] == pytest.approx(refit["ddp"]["lr"])  # fresh optimizer and scheduler in the second fit


def test_second_fit_with_another_precision_names_the_difference(out):
    message = load_json(out, "refit")["other_precision"]
    assert message.startswith("ValueError: this LightningModule is already under a ZeRO engine")
    assert "bf16.enabled" in message


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_fabric_gan_with_two_optimizers_matches_fabric_ddp(out, stage):
    reference = load_rank(out, "fabric_gan_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"fabric_gan_{stage}", rank)) <= WEIGHT_TOLERANCE
