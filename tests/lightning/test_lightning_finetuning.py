"""Lightning's BackboneFinetuning through a real 2-process Trainer.fit under zero1/2/3: the backbone, frozen at
fit start, joins the optimizer at epoch 1 through add_param_group. The reference is DDP, helped to average the
backbone it did not register (lightning/scripts/finetuning.py)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5  # float reordering only


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("finetuning")
    run("finetuning.py", str(path), timeout=400)
    return path


@pytest.mark.timeout(450)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_backbone_finetuning_matches_one_process(out, stage):
    reference = load_rank(out, "finetune_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"finetune_{stage}", rank)) <= WEIGHT_TOLERANCE
    expected, got = load_json(out, "finetune")["ddp"], load_json(out, "finetune")[stage]
    assert got["group_sizes"] == expected["group_sizes"] == [2, 6]  # the head's group, then the backbone's
    assert got["lrs"] == pytest.approx(expected["lrs"])
    assert got["global_step"] == expected["global_step"]


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_backbone_finetuning_resumes_after_the_unfreezing_like_ddp(out, stage):
    reference = load_rank(out, "finetune_ddp_resumed")
    assert max_diff(reference, load_rank(out, "finetune_ddp")) > 1e-4  # the resumed runs differ from the whole one
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"finetune_{stage}_resumed", rank)) <= WEIGHT_TOLERANCE
