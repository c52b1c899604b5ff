"""Real 2-process Trainer.fit runs (Lightning's own launcher): ZeRO 1/2/3 against DDP, checkpoints, resume, convert.

One launched script (lightning/scripts/fit_parity.py) fits DDP, zero1, zero2 and zero3 with gradient
accumulation (a partial last window), norm clipping, a step-interval scheduler, torchmetrics metrics logged with
sync_dist, a LearningRateMonitor and two ModelCheckpoints; then validate / test(ckpt_path="best") / predict.
It resumes zero3 from its epoch-0 checkpoint, converts that checkpoint to one file and resumes DDP from it;
finally it damages last.ckpt and resumes with ckpt_path="last" (the newest verified checkpoint).
"""

from __future__ import annotations

import pytest
import torch

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5  # float reordering only
STAGES = ("zero1", "zero2", "zero3")
FORMAT_FILES = {"manifest.json", "replicated.safetensors", "client_state.pt", "client_state.safetensors",
                "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit_parity")
    run("fit_parity.py", str(path), timeout=380)
    return path


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", STAGES)
def test_stage_ends_with_ddp_weights_metrics_and_predictions(out, stage):
    reference = load_rank(out, "ddp.weights")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"{stage}.weights", rank)) <= WEIGHT_TOLERANCE
    assert (load_rank(out, "ddp.predict") - load_rank(out, f"{stage}.predict")).abs().max() <= 1e-5
    ddp, zero = load_json(out, "ddp"), load_json(out, stage)
    assert zero["global_step"] == ddp["global_step"] == 4  # 2 epochs x (4 + a partial window of 2)
    assert zero["lr"] == pytest.approx(ddp["lr"])
    for part in ("fit", "validate", "test_best"):
        assert zero[part].keys() == ddp[part].keys()
        for key, value in ddp[part].items():
            assert zero[part][key] == pytest.approx(value, abs=1e-5), (part, key)
    assert zero["optimizer"] == ["ZeroOptimizer", "AdamW"]  # the user's optimizer, behind the engine's facade


def test_checkpoints_are_sharded_directories_with_top_k_and_last_link(out):
    zero3 = load_json(out, "zero3")
    assert zero3["best_files"] == ["epoch=1.ckpt"]  # save_top_k=1 removed epoch 0's directory
    assert zero3["epoch_files"] == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    epochs = out / "zero3" / "epochs"
    assert (epochs / "last.ckpt").is_symlink() and (epochs / "last.ckpt").resolve().name == "epoch=1.ckpt"
    for directory in (epochs / "epoch=0.ckpt", out / "zero3" / "best" / "epoch=1.ckpt"):
        assert {p.name for p in directory.iterdir()} == FORMAT_FILES
    assert {p.name for p in (out / "zero3" / "twice.ckpt").iterdir()} == FORMAT_FILES
    assert sorted(p.name for p in (out / "zero3").iterdir()) == ["best", "epochs", "twice.ckpt", "version_0"]
    client = torch.load(epochs / "epoch=0.ckpt" / "client_state.pt", weights_only=True)
    assert {"state_dict", "optimizer_states"}.isdisjoint(client)  # the engine's files hold those, sharded
    assert {"loops", "callbacks", "lr_schedulers", "hyper_parameters", "epoch", "global_step"} <= set(client)


def test_resume_from_epoch_checkpoint_equals_uninterrupted_run(out):
    assert max_diff(load_rank(out, "zero3.weights"), load_rank(out, "zero3_resumed.weights")) == 0.0
    assert load_json(out, "zero3_resumed")["global_step"] == 4


def test_ckpt_path_last_skips_a_damaged_last_checkpoint(out):
    """last.ckpt (-> epoch=1.ckpt) truncated: fit(ckpt_path="last") resumes from epoch=0.ckpt, warns, and ends
    with the uninterrupted run's weights."""
    resumed = load_json(out, "zero3_last_resumed")
    assert resumed["started_at"] == 2 and resumed["global_step"] == 4
    assert any("epoch=1.ckpt" in w and "truncated" in w for w in resumed["warnings"]), resumed["warnings"]
    assert max_diff(load_rank(out, "zero3.weights"), load_rank(out, "zero3_last_resumed.weights")) == 0.0


def test_fresh_trainer_tests_from_sharded_best_checkpoint(out):
    zero3 = load_json(out, "zero3")
    assert zero3["test_fresh"]["test_loss"] == pytest.approx(zero3["test_best"]["test_loss"], abs=1e-6)


def test_ddp_single_file_checkpoint_resumes_zero3(out):
    assert max_diff(load_rank(out, "ddp.weights"), load_rank(out, "zero3_from_ddp.weights")) <= WEIGHT_TOLERANCE


def test_converted_file_resumes_ddp_and_loads_with_load_from_checkpoint(out):
    assert max_diff(load_rank(out, "ddp.weights"), load_rank(out, "ddp_from_zero3.weights")) <= WEIGHT_TOLERANCE
    loaded = torch.load(out / "zero3_loaded.pt", weights_only=True)
    assert max_diff(load_rank(out, "zero3.weights"), loaded) == 0.0  # the saved model is the one in memory
    single = torch.load(out / "zero3_last.ckpt", weights_only=True)
    assert torch.equal(single["state_dict"]["model.head.weight"], single["state_dict"]["model.tok.weight"])
    assert len(single["optimizer_states"]) == 1 and single["optimizer_states"][0]["state"]
