"""Real 2-process runs of what is not plain automatic fp32 training: manual optimization, bf16/fp16, sync_batchnorm,
Fabric, and the errors that must be clear (lightning/scripts/features.py runs them all in one launch)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("features")
    run("features.py", str(path), timeout=280)
    return path


@pytest.mark.timeout(300)
def test_manual_optimization_with_value_clipping_matches_ddp(out):
    reference = load_rank(out, "manual_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, "manual_zero3", rank)) <= WEIGHT_TOLERANCE


@pytest.mark.parametrize("run_name, dtype", [("bf16_mixed", "bfloat16"), ("bf16_true_configure_model", "bfloat16"),
                                             ("fp16_mixed", "float16")])
def test_16_bit_precision_trains_with_fp32_masters_and_ranks_agree(out, run_name, dtype):
    result = load_json(out, "precision")[run_name]
    assert result["plugin"] == "ZeroPrecision"
    assert result["probe"]["param"] == f"torch.{dtype}" and result["probe"]["master"] == "torch.float32"
    assert result["fit"]["train_loss"] < 3.9 and result["test"] < 3.9  # ln(37) = 3.61 at the start: finite, sane
    rank0, rank1 = load_rank(out, f"precision_{run_name}", 0), load_rank(out, f"precision_{run_name}", 1)
    assert max_diff(rank0, rank1) == 0.0
    assert rank0["_skipped"] == rank1["_skipped"]  # fp16: every rank skipped the same overflowing steps


def test_fp16_loss_scaling_skips_overflowing_steps(out):
    fp16 = load_json(out, "precision")["fp16_mixed"]
    assert fp16["flag"] == "16-mixed"
    assert 0 < fp16["probe"]["skipped"] < 12 and fp16["probe"]["loss_scale"] < 2**24


def test_sync_batchnorm_converts_and_evaluates(out):
    assert load_json(out, "sync_batchnorm")["converted"] == "SyncBatchNorm"


def test_fabric_zero3_matches_fabric_ddp_and_checkpoint_round_trips(out):
    zero3 = load_rank(out, "fabric_zero3")
    assert max_diff(load_rank(out, "fabric_ddp"), zero3) <= WEIGHT_TOLERANCE
    assert max_diff(zero3, load_rank(out, "fabric_zero3_loaded")) == 0.0
    assert max_diff(load_rank(out, "fabric_ddp"), load_rank(out, "fabric_zero3_from_ddp")) == 0.0  # a DDP file
    fabric = load_json(out, "fabric")
    assert fabric["rest"] == ["step"] and fabric["step"] == 5 and fabric["optimizer_state"] > 0


def test_clear_errors(out):
    errors = load_json(out, "errors")
    assert errors["lbfgs"].startswith("TypeError: LBFGS")
    assert errors["missing_checkpoint"].startswith("FileNotFoundError: no checkpoint at")
    assert "returning None in distributed training is not supported" in errors["return_none"]  # as with DDP
