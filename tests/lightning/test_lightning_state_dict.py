"""``lightning_module_state_dict()`` / Fabric's ``get_module_state_dict`` under ZeRO against DDP's, from one
2-process launch (lightning/scripts/state_dict.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_runs import load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5  # float reordering only


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("state_dict")
    run("state_dict.py", str(path), timeout=280)
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_full_state_dict_is_ddps_on_rank_0_and_empty_elsewhere(out, stage):
    ddp = load_rank(out, "state_dict_ddp")
    full = load_rank(out, f"state_dict_{stage}")
    assert list(full) == load_rank(out, "state_dict_ddp_keys")  # every key, in state_dict() order
    assert all(t.device == torch.device("cpu") for t in full.values())
    assert max_diff(ddp, full) <= WEIGHT_TOLERANCE
    assert "model.pos.weight" in full  # a frozen parameter comes out too
    assert load_rank(out, f"state_dict_{stage}", rank=1) == {}


def test_exclude_frozen_parameters_leaves_the_frozen_embedding_out_and_resumes(out):
    for rank in (0, 1):
        result = load_rank(out, "excluded", rank=rank)
        assert result["excluded"] == ["model.pos.weight"], result
        assert result["equal"], rank


def test_a_weights_only_checkpoint_holds_no_optimizer_state_validates_and_refuses_a_resume(out):
    for rank in (0, 1):
        result = load_rank(out, "weights_only", rank=rank)
        assert result["classes"] == [] and result["keys"] == [], result
        assert result["equal"], rank
        assert result["refused"] is not None and "save_weights_only" in result["refused"], result


def test_fabric_saves_the_optimizer_state_only_when_the_state_names_the_optimizer(out):
    classes = load_rank(out, "fabric_saved_optimizer")
    assert classes["model"] == [] and classes["model_optimizer"] == ["torch.optim.adamw.AdamW"], classes
    assert "holds no optimizer state" in classes["refused"], classes  # and strict=False loads it


def test_sharded_state_dict_is_empty(out):
    assert load_rank(out, "state_dict_zero3_sharded", rank=0) == {}
    assert load_rank(out, "state_dict_zero3_sharded", rank=1) == {}


def test_full_state_dict_under_bf16_gives_the_fp32_masters(out):
    full = load_rank(out, "state_dict_zero2_bf16")
    assert full.pop("_param_dtype").item() == 1.0 and full.pop("_master_dtype").item() == 1.0
    weight = full["model.blocks.0.fc1.weight"]
    assert weight.dtype == torch.float32
    assert (weight != weight.to(torch.bfloat16).float()).any()  # not a bf16 copy cast up


def test_fabric_full_module_state_dict_matches_fabric_ddp(out):
    ddp = load_rank(out, "state_dict_fabric_ddp")
    zero3 = load_rank(out, "state_dict_fabric_zero3")
    assert list(zero3) == list(ddp)
    assert max_diff(ddp, zero3) <= WEIGHT_TOLERANCE
    assert load_rank(out, "state_dict_fabric_zero3", rank=1) == {}
