"""A sharded optimizer's ``state_dict()`` says what it is, and ``load_state_dict`` accepts only that.

``engine.optimizer.state_dict()`` is this rank's shard: it carries ``zero_shard`` (rank, world size, stage and
the layout: each master shard's parameter pieces). Loading it back on the same rank restores the state exactly
(also after ``torch.save``/``torch.load(weights_only=True)``); another rank's shard, a shard of another world
size or layout, a partial state and a plain torch optimizer state are each refused with a message naming the
fix; so is a shard given to ``load_full_state_dict`` as if it were a whole optimizer state. One spawn of 2
ranks covers stages 1, 2 and 3, and Lightning's ``ZeroOptimizer``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist

import zero_core
from zero_core.checkpoint import CheckpointError, load_full_state_dict
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer

WORLD = 2
STAGES = (1, 2, 3)


def _engine(stage: int, group=None, optimizer_fn=make_optimizer) -> zero_core.ZeroEngine:
    model = build_model("mlp")
    config = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return zero_core.setup(model, optimizer_fn(model), config, process_group=group)


def _train(engine: zero_core.ZeroEngine, rank: int, steps: range) -> None:
    for step in steps:
        engine.backward(engine.module(*make_batch("mlp", rank, step, 0)))
        engine.step()


def _error(load, *args) -> str:
    try:
        load(*args)
    except (ValueError, CheckpointError) as error:
        return str(error)
    return "loaded"


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(
        sorted(a[i]) == sorted(b[i]) and all(torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k]))
                                             for k in a[i]) for i in a)


def _cases(rank: int, stage: int, solo_group) -> dict:
    engine = _engine(stage)
    _train(engine, rank, range(2))
    saved = _round_trip(engine.optimizer.state_dict())
    _train(engine, rank, range(2, 3))  # the live state moves on
    load = engine.optimizer.load_state_dict
    load(saved)
    out = {"identity": {k: v for k, v in saved["zero_shard"].items() if k != "groups"},
           "names": sorted({p[0] for group in saved["zero_shard"]["groups"] for m in group for p in m["params"]}),
           "restored": _same_state(engine.optimizer.state_dict()["state"], saved["state"])}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, saved)
    out["other_rank"] = _error(load, everyone[1 - rank])
    plain_model = build_model("mlp")
    plain = make_optimizer(plain_model)
    plain_model(*make_batch("mlp", rank, 0, 0)).backward()
    plain.step()
    out["plain"] = _error(load, plain.state_dict())
    partial = copy.deepcopy(saved)
    partial["state"].pop(next(iter(partial["state"])))
    out["partial_state"] = _error(load, partial)
    fewer = copy.deepcopy(saved)
    fewer["param_groups"][0]["params"] = fewer["param_groups"][0]["params"][:-1]
    out["partial_groups"] = _error(load, fewer)
    one_group = _engine(stage, optimizer_fn=lambda m: torch.optim.AdamW(m.parameters()))
    out["other_layout"] = _error(one_group.optimizer.load_state_dict, saved)
    solo = _engine(stage, group=solo_group)
    out["other_world"] = _error(solo.optimizer.load_state_dict, saved)
    weights = engine.full_state_dict(rank0_only=False)
    out["shard_as_whole"] = _error(load_full_state_dict, engine, weights, saved)
    return out


def _worker(rank: int, world_size: int) -> dict:
    solo_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    results = {stage: _cases(rank, stage, solo_groups[rank]) for stage in STAGES}
    from lightning_zero.strategy import ZeroOptimizer

    engine = _engine(3)
    _train(engine, rank, range(1))
    lightning = ZeroOptimizer(engine, 0)
    state = lightning.state_dict()
    lightning.load_state_dict(state)
    results["lightning"] = {"rank": state["zero_shard"]["rank"], "other_rank": _error(
        lightning.load_state_dict, {**state, "zero_shard": {**state["zero_shard"], "rank": 1 - rank}})}
    return results


@pytest.fixture(scope="module")
def results() -> list:
    return run_distributed(_worker, WORLD, timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_names_its_rank_topology_and_layout_and_loads_back_exactly(results, stage):
    for rank, result in enumerate(results):
        cases = result[stage]
        identity = cases["identity"]
        assert (identity["rank"], identity["world_size"], identity["stage"], identity["optimizer"]) == \
            (rank, WORLD, stage, 0)
        assert identity["format"] == "zero_core.optimizer_shard/1" and len(identity["layout_fingerprint"]) == 16
        assert identity["stateful"] and cases["names"]
        assert cases["restored"]
    # between them, the ranks' layouts name every trainable parameter (the frozen layer has no optimizer state)
    assert set(results[0][stage]["names"]) | set(results[1][stage]["names"]) == {
        "inp.bias", "inp.weight", "norm.bias", "norm.weight", "out.bias", "out.weight"}


@pytest.mark.parametrize("stage", STAGES)
def test_loading_anything_but_this_ranks_own_shard_is_an_error_naming_the_fix(results, stage):
    for rank, result in enumerate(results):
        cases = result[stage]
        other = cases["other_rank"]
        assert f"shard of rank {1 - rank} of 2" in other and f"this is rank {rank} of 2" in other
        assert "engine.save_checkpoint/load_checkpoint" in other and "accelerator.save_state" in other
        assert "plain torch optimizer state" in cases["plain"] and "load_full_state_dict" in cases["plain"]
        assert "partial state" in cases["partial_state"] and "held state when it was saved" in cases["partial_state"]
        assert "partial state" in cases["partial_groups"]
        assert "another layout" in cases["other_layout"] and "2 parameter groups saved, 1 here" in cases["other_layout"]
        assert f"shard of rank {rank} of 2" in cases["other_world"] and "this is rank 0 of 1" in cases["other_world"]
        assert f"one rank's shard (rank {rank} of 2" in cases["shard_as_whole"]


def test_lightnings_zero_optimizer_carries_the_same_identity(results):
    for rank, result in enumerate(results):
        assert result["lightning"]["rank"] == rank
        assert "ZeroOptimizer.load_state_dict" in result["lightning"]["other_rank"]
