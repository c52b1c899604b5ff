"""``ZeroStrategy(activation_checkpointing_policy=...)`` and ``ZeroFabricStrategy``'s, FSDPStrategy's switch: at
stage 3 with full partitioning and ``cpu_checkpointing``, 2 ranks, the Trainer and Fabric train to the weights
DDP gives with plain ``torch.utils.checkpoint`` on the same blocks, and the checkpointed inputs went through the
engine's host stash (tests/lightning/scripts/activation_checkpointing.py runs both in one launch)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_runs import load_json, load_rank, max_diff, run
from lightning_zero import ZeroStrategy
from lightning_zero.activation_checkpointing import apply_activation_checkpointing, matching_modules

WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("activation_checkpointing")
    run("activation_checkpointing.py", str(path), timeout=200)
    return path


@pytest.mark.timeout(220)
def test_trainer_policy_at_stage3_with_cpu_checkpointing_matches_ddp(out):
    reference = load_rank(out, "trainer_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, "trainer_zero3", rank)) <= WEIGHT_TOLERANCE
    found = load_json(out, "activation_checkpointing")["lightning"]
    assert found["stage"] == 3 and found["forwards"] == ["CheckpointedForward"] * 2
    stats = found["stats"]  # every block's input waited in host memory and came back for its recomputation
    assert stats["stashed"] > 0 and stats["restored"] == stats["stashed"] and stats["host_bytes"] > 0


def test_fabric_policy_at_stage3_with_cpu_checkpointing_matches_ddp(out):
    reference = load_rank(out, "fabric_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, "fabric_zero3", rank)) <= WEIGHT_TOLERANCE
    stats = load_json(out, "activation_checkpointing")["fabric"]["stats"]
    assert stats["stashed"] > 0 and stats["restored"] == stats["stashed"]


class Inner(nn.Linear):
    pass


def test_policy_kinds_select_the_outermost_modules_and_keep_names():
    model = nn.Sequential(nn.Sequential(Inner(2, 2), nn.ReLU()), Inner(2, 2))
    names = [n for n, _ in model.named_parameters()]
    assert matching_modules(model, {Inner}) == [model[0][0], model[1]]
    assert matching_modules(model, {nn.Sequential}) == [model]  # the inner Sequential runs inside the root's
    assert matching_modules(model, ModuleWrapPolicy({Inner})) == [model[0][0], model[1]]
    assert matching_modules(model, lambda module, recurse, nonwrapped_numel: isinstance(module, nn.ReLU)) == [
        model[0][1]]
    assert apply_activation_checkpointing(model, {Inner}) == 2 == apply_activation_checkpointing(model, {Inner})
    assert [n for n, _ in model.named_parameters()] == names


def test_policy_of_the_wrong_kind_is_a_clear_error():
    with pytest.raises(TypeError, match="activation_checkpointing_policy.*set of nn.Module classes"):
        ZeroStrategy(activation_checkpointing_policy={"Block"})
    with pytest.raises(TypeError, match="activation_checkpointing_policy"):
        ZeroStrategy(activation_checkpointing_policy=3)
