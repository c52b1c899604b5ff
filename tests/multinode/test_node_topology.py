"""Two simulated nodes of two ranks (gloo on localhost): node topology, MiCS, hpZ, qwZ/qgZ, link counters.

One spawn of 4 processes, with the launcher's multi-node environment (distributed.py, ``nodes=2``), runs the
DDP reference and every configuration; the tests below read its results.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, train_ddp
from stage3_support import train_engine

STEPS = 6
WEIGHT_TOLERANCE = 1e-5  # fp32, float reordering only
MODEL = "transformer"

# name -> zero_optimization settings (fp32). Stage 3 without persistent units, so every unit is gathered by
# the hooks in the forward and again in the backward (no reuse), which is where hpZ and qwZ act.
Z3 = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0}
EXACT = {
    "zero3": Z3,
    "zero3_hpz": {**Z3, "zero_hpz_partition_size": 2},
    "mics1": {"stage": 1, "mics_shard_size": 2},
    "mics2": {"stage": 2, "mics_shard_size": 2},
    "mics3": {**Z3, "mics_shard_size": 2},
    "zero3_hier": {**Z3, "mics_shard_size": 4, "mics_hierarchical_params_gather": True},
}
QUANTIZED = {
    "zero3_qwz": {**Z3, "zero_quantized_weights": True},
    "zeropp": {**Z3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
               "zero_quantized_gradients": True},
    # 8-bit codes (uint8) and their scales and minima through the two-hop gather
    "zero3_hier_qwz": {**Z3, "mics_shard_size": 4, "mics_hierarchical_params_gather": True,
                       "zero_quantized_weights": True},
}


def _model():
    return build_model(MODEL)


def _data(rank, step, micro):
    return make_batch(MODEL, rank, step, micro)


def _one_step_stats(engine, rank: int) -> dict:
    """Counters of one more training step (the trace is recorded by then), and memory before its update."""
    engine.reset_comm_stats()
    loss = engine.module(*_data(rank, STEPS, 0))
    forward = {kind: dict(entry) for kind, entry in engine.comm_stats().items()}  # the counters are cumulative
    engine.backward(loss)
    memory = engine.memory_stats()
    engine.step()
    return {"comm": engine.comm_stats(), "forward_comm": forward, "links": engine.link_bytes(), "memory": memory}


def _checkpoints(rank: int, directory: str) -> dict:
    """A MiCS stage 3 checkpoint (2 replicas of 2 shards) loads into plain stage 1 and into MiCS stage 2."""
    import zero_core

    _, engine = train_engine(_model, _data, {"stage": 3, "mics_shard_size": 2}, 2)
    path = Path(directory) / "mics"
    engine.save_checkpoint(path)
    expected = engine.full_state_dict(rank0_only=False)
    files = sorted(p.name for p in path.iterdir() if p.name.startswith("shard-"))
    errors = {}
    for name, config in {"stage1": {"stage": 1}, "mics2": {"stage": 2, "mics_shard_size": 2}}.items():
        model = build_model(MODEL, seed=5)  # other initial weights: the load must replace them all
        other = zero_core.setup(model, make_optimizer(model), config)
        other.load_checkpoint(path)
        loaded = other.full_state_dict(rank0_only=False)
        errors[name] = max((loaded[k] - expected[k]).abs().max().item() for k in expected)
        other.close()
    engine.close()
    return {"files": files, "errors": errors}


def _frozen_model():
    """The embedding frozen (a LoRA-like run): its gathers are the non-trainable weights qwZ can quantise."""
    model = _model()
    model.tok.weight.requires_grad_(False)
    return model


def _frozen(rank: int) -> dict:
    """``zero_quantized_nontrainable_weights``: frozen units' gathers are int8, trainable ones stay exact."""
    reference = train_ddp(_frozen_model, _data, STEPS)
    out = {"ddp_losses": reference.losses}
    for name, extra in {"plain": {}, "quantized": {"zero_quantized_nontrainable_weights": True},
                        # stored 8-bit frozen shards under hpZ: the backward gathers the in-node 16-bit copy
                        "quantized_hpz": {"zero_quantized_nontrainable_weights": True,
                                          "zero_hpz_partition_size": 2}}.items():
        result, engine = train_engine(_frozen_model, _data, {**Z3, **extra}, STEPS)
        out[name] = {"losses": result.losses, "diff": max((result.params[k] - reference.params[k]).abs().max().item()
                                                          for k in reference.params), **_one_step_stats(engine, rank)}
        engine.close()
    return out


def _bad_sizes() -> dict:
    """Sizes that do not divide the 4 ranks: a clear error on every rank, before any collective."""
    import zero_core

    errors = {}
    for name, config in {"mics": {"stage": 3, "mics_shard_size": 3},
                         "hpz": {"stage": 3, "zero_hpz_partition_size": 3}}.items():
        model = _model()
        try:
            zero_core.setup(model, make_optimizer(model), config)
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _run_all(rank: int, world_size: int, directory: str) -> dict:
    reference = train_ddp(_model, _data, STEPS)
    out = {"ddp_losses": reference.losses, "frozen": _frozen(rank), "bad_sizes": _bad_sizes()}
    for name, config in {**EXACT, **QUANTIZED}.items():
        result, engine = train_engine(_model, _data, config, STEPS)
        diff = max((result.params[k] - reference.params[k]).abs().max().item() for k in reference.params)
        topology = engine.topology
        out[name] = {"diff": diff, "losses": result.losses, **_one_step_stats(engine, rank),
                     "topology": (topology.world_size, topology.replicas, topology.nodes, topology.mesh is not None)}
        engine.close()
    out["checkpoint"] = _checkpoints(rank, directory)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multinode")
    return run_distributed(_run_all, 4, str(directory), nodes=2, timeout=280)


def test_topology_reads_nodes_from_launcher_environment(results):
    for rank_result in results:
        assert rank_result["zero3"]["topology"] == (4, 1, 2, True)  # 2 nodes, a (node, local) mesh
        assert rank_result["mics3"]["topology"] == (2, 2, 2, True)  # shard groups of 2, 2 replicas


@pytest.mark.parametrize("name", list(EXACT))
def test_hpz_and_mics_train_like_ddp(results, name):
    for rank, rank_result in enumerate(results):
        assert rank_result[name]["diff"] <= WEIGHT_TOLERANCE, (rank, name, rank_result[name]["diff"])


def _cross(entry: dict, kind: str) -> int:
    return entry["comm"][kind]["cross_node_bytes"]


def test_link_counters_show_what_each_layout_sends_across_nodes(results):
    for rank_result in results:
        zero3 = rank_result["zero3"]
        assert _cross(zero3, "all_gather") > 0 and _cross(zero3, "reduce_scatter") > 0
        assert zero3["links"]["cross_node"] == sum(e["cross_node_bytes"] for e in zero3["comm"].values())
        # hpZ: the backward gathers inside the node, so only the forward's gathers cross; stage 3's backward
        # gathers cross too (units the backward uses again are gathered again: max_reuse_distance 0)
        hpz = rank_result["zero3_hpz"]
        assert _cross(hpz, "all_gather") == hpz["forward_comm"]["all_gather"]["cross_node_bytes"] > 0
        assert _cross(zero3, "all_gather") > zero3["forward_comm"]["all_gather"]["cross_node_bytes"]
        assert _cross(hpz, "all_gather") < _cross(zero3, "all_gather")
        assert rank_result["zero3_hpz"]["comm"]["all_gather"]["in_node_bytes"] > zero3["comm"]["all_gather"]["in_node_bytes"]
        # MiCS inside a node: parameters and the reduce-scatter never leave it; replicas all-reduce across
        mics = rank_result["mics3"]
        assert _cross(mics, "all_gather") == 0 and _cross(mics, "reduce_scatter") == 0
        assert _cross(mics, "all_reduce") > 0
        # the hierarchical gather sends each shard across once, not to each remote rank
        assert _cross(rank_result["zero3_hier"], "all_gather") * 2 == _cross(zero3, "all_gather")


def test_zeropp_cuts_cross_node_bytes_fourfold_and_trains_close_to_ddp(results):
    for rank_result in results:
        zero3, zeropp = rank_result["zero3"], rank_result["zeropp"]
        ratio = zeropp["links"]["cross_node"] / zero3["links"]["cross_node"]
        assert ratio <= 0.25, ratio
        assert zeropp["comm"]["all_gather"]["elements"] == zero3["comm"]["all_gather"]["elements"]
        for name in QUANTIZED:
            ddp, losses = rank_result["ddp_losses"], rank_result[name]["losses"]
            gaps = [abs(a - b) / abs(b) for a, b in zip(losses, ddp)]
            assert max(gaps) < 0.02, (name, gaps)
            assert rank_result[name]["diff"] > 0  # the wire format really was quantised (Adam turns the rounding
            # of small gradients into steps of up to lr, so the weights are compared through the loss)


def test_hpz_secondary_partition_counts_in_memory_stats(results):
    for rank_result in results:
        extra = rank_result["zero3_hpz"]["memory"]["params"] - rank_result["zero3"]["memory"]["params"]
        # the in-node copy: half of the 16-bit (here fp32) parameters with 2 ranks per node, padding aside
        psi_bytes = rank_result["zero3"]["comm"]["reduce_scatter"]["bytes"]
        assert 0.45 * psi_bytes <= extra <= 0.6 * psi_bytes, (extra, psi_bytes)


def test_mics_checkpoint_is_written_once_and_loads_at_other_stages(results):
    checkpoint = results[0]["checkpoint"]
    assert checkpoint["files"] == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    for rank_result in results:
        for name, error in rank_result["checkpoint"]["errors"].items():
            assert error == 0.0, (name, error)


def test_quantized_nontrainable_weights_shrink_frozen_gathers_only(results):
    for rank_result in results:
        frozen = rank_result["frozen"]
        assert frozen["plain"]["diff"] <= WEIGHT_TOLERANCE
        plain, quantized = (frozen[k]["comm"]["all_gather"] for k in ("plain", "quantized"))
        assert quantized["elements"] == plain["elements"] and quantized["bytes"] < plain["bytes"]
        assert frozen["quantized"]["diff"] > 0
        for name in ("quantized", "quantized_hpz"):
            gaps = [abs(a - b) / abs(b) for a, b in zip(frozen[name]["losses"], frozen["ddp_losses"])]
            assert max(gaps) < 0.02, (name, gaps)
        # the frozen shards are 8-bit in memory: fewer parameter bytes than the plain run
        assert frozen["quantized"]["memory"]["params"] < frozen["plain"]["memory"]["params"]


def test_group_sizes_that_do_not_divide_the_world_are_named(results):
    for rank_result in results:
        errors = rank_result["bad_sizes"]
        assert "mics_shard_size=3 must divide the number of ranks (4)" in errors["mics"]
        assert "zero_hpz_partition_size=3 must divide the number of ranks (4)" in errors["hpz"]


@pytest.mark.parametrize("config, message", [
    ({"stage": 2, "zero_quantized_weights": True}, "zero_quantized_weights \\(ZeRO\\+\\+\\) needs stage 3"),
    ({"stage": 1, "zero_hpz_partition_size": 2}, "zero_hpz_partition_size \\(ZeRO\\+\\+\\) needs stage 3"),
    ({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2}, "does not combine with"),
    ({"stage": 3, "mics_shard_size": 2, "zero_quantized_gradients": True}, "does not combine with"),
])
def test_config_rejects_zeropp_combinations_that_cannot_work(config, message):
    from zero_core import ZeroConfig, ZeroConfigError

    with pytest.raises(ZeroConfigError, match=message):
        ZeroConfig(**config)


@pytest.mark.parametrize("name", ["zero3", "zero3_hpz", "mics1", "mics2", "mics3"])
def test_estimator_counts_hpz_secondary_and_mics_replication(results, name):
    """Model states measured after a backward (hpZ's copy is alive, gradients too) against zero-estimate."""
    from zero_core.tools.estimator import estimate_stage, model_info

    config = {**EXACT[name], "reduce_bucket_size": 500_000_000}
    estimate = estimate_stage(model_info(build_model(MODEL)), config, 4, precision="fp32")
    for rank_result in results:
        memory = rank_result[name]["memory"]
        measured = sum(memory[c] for c in ("params", "grads", "fp32_master", "optimizer_state"))
        assert abs(measured / estimate.model_states - 1) <= 0.05, (name, memory, estimate)
