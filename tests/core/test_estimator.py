"""zero_core.tools.estimator against the ZeRO paper's table, hand-computed padding, and a real 2-rank engine."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_distributed
from models import build_model, make_batch
from zero_core.tools.estimate_cli import run as cli
from zero_core.tools.estimator import (
    ModelInfo,
    ParamInfo,
    estimate_memory,
    estimate_stage,
    model_info,
    paper_bytes_per_param,
)

GB = 1e9
# The paper (section 5, figure 1): 7.5B parameters, Nd = 64, mixed-precision Adam (K = 12).
PAPER_TABLE_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def test_reproduces_the_papers_table():
    estimates = estimate_memory(7.5e9, world_size=64, precision="fp16")
    assert [e.stage for e in estimates] == [0, 1, 2, 3]
    for e in estimates:
        assert round(e.model_states / GB, 1) == PAPER_TABLE_GB[e.stage], e


def test_paper_formulas_fp32_and_mixed():
    assert [paper_bytes_per_param(s, 2, "fp32") for s in range(4)] == [16, 12, 10, 8]
    assert [paper_bytes_per_param(s, 64, "bf16") for s in range(4)] == [16, 4 + 12 / 64, 2 + 14 / 64, 16 / 64]
    for stage in range(4):
        e = estimate_stage(640, {"stage": stage}, 64, precision="fp32")
        assert e.per_param() == paper_bytes_per_param(stage, 64, "fp32")


def test_padding_follows_the_flat_layout():
    # 5 + 7 elements in one bucket on 4 ranks: the bucket pads to 12, each rank owns 3.
    info = ModelInfo((ParamInfo(5, 4, module="a"), ParamInfo(7, 4, module="b")))
    s1, s2, s3 = estimate_memory(info, {"reduce_bucket_size": 100, "allgather_bucket_size": 100}, 4,
                                 stages=[1, 2, 3], precision="fp32")
    # Adam's state: 8 bytes per owned element (padding has none) and a 4-byte step per piece; rank 1 owns
    # a[3:5] and b[0:1], two pieces, the most of any rank; rank 3 owns b[4:7], one piece.
    assert (s1.params, s1.grads, s1.optimizer_state) == (12 * 4, 12 * 4, 3 * 8 + 2 * 4)
    assert (s2.params, s2.grads, s2.optimizer_state) == (12 * 4, 3 * 4, 3 * 8 + 2 * 4)
    assert estimate_stage(info, {"stage": 2}, 4, precision="fp32", rank=3).optimizer_state == 3 * 8 + 4
    # Stage 3 pads each unit (one module's parameters): 5 -> 8 and 7 -> 8, 2 + 2 elements per rank; both units
    # are under param_persistence_threshold, so they also stay gathered (8 + 8 elements).
    assert (s3.params, s3.grads, s3.fp32_master) == ((4 + 16) * 4, 4 * 4, 0)
    no_persistence = {"stage": 3, "param_persistence_threshold": 0}
    assert estimate_stage(info, no_persistence, 4, precision="fp32").params == 4 * 4
    budget = {"stage": 3, "model_persistence_threshold": 6}  # room for the first unit (5 elements) only
    assert estimate_stage(info, budget, 4, precision="fp32").params == (4 + 8) * 4
    # Buckets of 6 elements: [5] pads to 8 and [7] to 8, so 16 in all and 4 per rank.
    small = estimate_stage(info, {"stage": 2, "reduce_bucket_size": 6, "allgather_bucket_size": 6}, 4,
                           precision="fp32")
    assert (small.params, small.grads) == (16 * 4, 4 * 4)


def test_mixed_precision_classes():
    e = estimate_stage(1000, {"stage": 2, "bf16": {"enabled": True}}, 4)
    assert e.precision == "bf16"
    assert (e.params, e.grads, e.fp32_master, e.optimizer_state) == (2000, 500, 1000, 2000)


def test_meta_model_and_live_parameters():
    from models import TinyTransformer, trainable_numel

    with torch.device("meta"):
        model = TinyTransformer()
    info = model_info(model)
    assert all(p.is_meta for p in model.parameters())
    assert info.trainable_numel == trainable_numel(TinyTransformer())
    config = {"stage": 3, "max_live_parameters": 1000, "param_persistence_threshold": 0}
    stage3 = estimate_stage(info, config, 8, precision="fp32")
    # At least the largest unit is gathered at once: a block's (or a module's) parameters, one optimizer group
    # here, padded to a multiple of 8 (stage3_support recomputes the owners, for decay groups).
    from stage3_support import expected_units

    owned: dict = {}
    for unit in expected_units(TinyTransformer(), 8):
        owned[unit["module"]] = owned.get(unit["module"], 0) + unit["numel"]
    assert stage3.live_params == max(-(-numel // 8) * 8 for numel in owned.values()) * 4


@pytest.mark.parametrize("bad, error", [
    (dict(world_size=0), ValueError), (dict(stages=[4]), ValueError), (dict(precision="fp8"), ValueError),
    (dict(optimizer_state_bytes=-1), ValueError),
])
def test_bad_input_raises(bad, error):
    kwargs = dict(world_size=2)
    kwargs.update(bad)
    with pytest.raises(error):
        estimate_memory(100, None, **kwargs)


def test_bad_subject_raises():
    with pytest.raises(ValueError):
        estimate_memory(-5)
    with pytest.raises(TypeError):
        estimate_memory("7.5e9")


def test_cli_prints_the_papers_table():
    out = cli(["--num-params", "7.5e9", "--world-size", "64"])
    assert "fp16" in out
    for value in ("120.0", "31.4", "16.6", "1.88"):
        assert f"| {value} |" in out


def test_cli_model_config_and_errors(tmp_path):
    config = tmp_path / "zero.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    out = cli(["--model", "models:TinyTransformer", "--world-size", "2", "8", "--config", str(config),
               "--stages", "2", "--unit", "MiB"])
    assert out.count("| 2 | ") == 2 and "bf16" in out and "MiB" in out
    with pytest.raises(ValueError):
        cli(["--world-size", "2"])  # neither --num-params nor --model
    with pytest.raises(ValueError):
        cli(["--model", "no_colon_here"])


def test_cli_param_groups_and_bucket_costs():
    base = ["--model", "models:TinyTransformer", "--world-size", "2", "--stages", "2", "--unit", "B",
            "--precision", "bf16"]
    one, split = cli(base), cli(base + ["--param-groups", "reference:decay_groups"])
    assert one != split  # two optimizer groups: two flat buffers, padded apart
    assert "step tile" in one and "reduce_bucket_size = 500,000,000 (default)" in one
    assert "a buffer can reach 1,000,000,000 bytes" in one  # DeepSpeed's 5e8 elements, in 16 bits
    with pytest.raises(ValueError, match="--param-groups needs --model"):
        cli(["--num-params", "1e6", "--param-groups", "reference:decay_groups"])


def test_overlap_follows_the_estimated_stage():
    """overlap_comm defaults to true for stage 3 only: a stage 2 config estimates stage 3 with its overlap."""
    from models import TinyTransformer

    model = TinyTransformer()
    from_stage2 = estimate_stage(model, {"stage": 2, **SMALL_BUCKETS}, 2, stage=3, precision="bf16")
    from_stage3 = estimate_stage(model, {"stage": 3, **SMALL_BUCKETS}, 2, precision="bf16")
    assert from_stage2 == from_stage3


def test_step_tile_counts_only_16_bit_gradients():
    info = ModelInfo((ParamInfo(600, 4, module="a"), ParamInfo(300, 4, module="b"), ParamInfo(500, 4, module="c")))
    tiles = {"sub_group_size": 1000, "reduce_bucket_size": 10_000, "allgather_bucket_size": 10_000}
    assert estimate_stage(info, {"stage": 2, **tiles}, 1, precision="fp32").step_tile == 0  # stepped in place
    # pieces 600, 300 | 500 packed into tiles of at most 1000 elements: the largest tile is 900 fp32 elements
    assert estimate_stage(info, {"stage": 2, **tiles}, 1, precision="bf16").step_tile == 900 * 4
    # a piece bigger than the tile is a tile alone
    assert estimate_stage(info, {"stage": 2, **tiles, "sub_group_size": 100}, 1, precision="bf16").step_tile == 600 * 4


# -- against the engine ----------------------------------------------------------------------------------

SMALL_BUCKETS = {"reduce_bucket_size": 100, "allgather_bucket_size": 100}
CASES = [(stage, precision) for stage in (1, 2, 3) for precision in ("fp32", "bf16")]


def _measure(rank: int, world_size: int) -> dict:
    import zero_core

    measured = {}
    for stage, precision in CASES:
        model = build_model("transformer")
        config = {"stage": stage, **SMALL_BUCKETS}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        dtype = next(model.parameters()).dtype
        for step in range(2):  # state exists from the first step on, stepped whole buckets from the second
            engine.backward(engine.module(*make_batch("transformer", rank, step, 0, dtype)))
            engine.step()
        measured[(stage, precision)] = engine.memory_stats()
    return measured


@pytest.mark.timeout(180)
def test_matches_the_engine_on_two_ranks():
    """Every class of memory_stats(), on each rank, exactly (tests/core/test_estimator_plan.py covers more models)."""
    results = run_distributed(_measure, 2, timeout=150)
    model = build_model("transformer")
    for rank, result in enumerate(results):
        for (stage, precision), stats in result.items():
            estimate = estimate_stage(model, {"stage": stage, **SMALL_BUCKETS}, 2, precision=precision, rank=rank)
            assert {c: getattr(estimate, c) for c in stats} == stats, (stage, precision, rank, estimate)
