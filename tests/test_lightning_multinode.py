"""A simulated 2-node x 2-device run (two Lightning launchers, NODE_RANK 0/1, MASTER_ADDR=127.0.0.1, one shared
MASTER_PORT) ends with the same weights as 1 node x 4 devices, and writes one checkpoint with four shards. Both
use hpZ over pairs of ranks; the engine sees 2 nodes (and counts cross-node bytes) only in the first layout."""

from __future__ import annotations

import pytest

from lightning_scripts.launch import finish, free_port, load_json, load_rank, max_diff, start


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
