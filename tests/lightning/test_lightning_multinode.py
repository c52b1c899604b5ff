"""A simulated 2-node x 2-device run (two Lightning launchers, NODE_RANK 0/1, MASTER_ADDR=127.0.0.1, one shared
MASTER_PORT) ends with the same weights as 1 node x 4 devices, and writes one checkpoint with four shards. Both
use hpZ over pairs of ranks; the engine sees 2 nodes (and counts cross-node bytes) only in the first layout."""

from __future__ import annotations

import pytest

from lightning_runs import finish, free_port, load_json, load_rank, max_diff, start


@pytest.mark.timeout(300)
def test_two_nodes_of_two_equal_one_node_of_four(tmp_path):
    single = start("multinode.py", str(tmp_path), "1x4")
    port = str(free_port())
    nodes = [start("multinode.py", str(tmp_path), "2x2",
                   env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)}) for node in (0, 1)]
    finish(single, 280, "1 node x 4 devices")
    for node, process in enumerate(nodes):
        finish(process, 280, f"node {node} of 2")
    reference = load_rank(tmp_path, "multinode_1x4")
    for rank in range(4):
        assert max_diff(reference, load_rank(tmp_path, "multinode_2x2", rank)) <= 1e-6
    two_nodes, one_node = load_json(tmp_path, "multinode_2x2"), load_json(tmp_path, "multinode_1x4")
    assert two_nodes["world_size"] == 4
    assert (two_nodes["zero_nodes"], one_node["zero_nodes"]) == (2, 1)
    assert two_nodes["cross_node_bytes"] > 0 and one_node["cross_node_bytes"] == 0
    shards = sorted(p.name for p in (tmp_path / "multinode_2x2.ckpt").glob("shard-*"))
    assert shards == [f"shard-0000{r}-of-00004.safetensors" for r in range(4)]


@pytest.mark.timeout(300)
def test_node_local_checkpoint_resumes_through_zero_strategy(tmp_path):
    """``checkpoint.use_node_local_storage`` on 2 nodes x 2 devices: each node (its own working directory, the
    same relative path) holds its ranks' shards and its own manifest; resuming from it ends like the
    uninterrupted fit."""
    port = str(free_port())
    directories = [tmp_path / f"node{node}" for node in (0, 1)]
    nodes = []
    for node, directory in enumerate(directories):
        directory.mkdir()
        nodes.append(start("node_local.py", str(tmp_path), cwd=directory,
                           env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node)}))
    for node, process in enumerate(nodes):
        finish(process, 280, f"node {node} of 2")
    for rank in range(4):
        straight = load_rank(tmp_path, "node_local_straight", rank)
        assert max_diff(straight, load_rank(tmp_path, "node_local_resumed", rank)) <= 1e-6, rank
    for node in (0, 1):
        report = load_json(tmp_path, f"node_local.node{node}")
        shards = [name for name in report["files"] if name.startswith("shard-")]
        assert shards == [f"shard-0000{r}-of-00004.safetensors" for r in (2 * node, 2 * node + 1)], report
        assert (report["node_local"]["node"], report["node_local"]["nodes"]) == (node, 2)
