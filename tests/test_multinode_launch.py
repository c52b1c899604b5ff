"""Two nodes as two real launcher invocations on localhost: ``torchrun --nnodes 2 --node-rank i`` (gloo).

The engine must find the nodes from the launcher's environment alone, and train like DDP under hpZ and MiCS
(and close to it under full ZeRO++). The script is tests/core_scripts/two_nodes.py.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "core_scripts" / "two_nodes.py"
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_torchrun_two_nodes_on_localhost(tmp_path):
    out, port = tmp_path / "report.json", _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "GROUP_", "WORLD_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(SCRIPT), str(out)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [node.communicate(timeout=TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    for i, node in enumerate(nodes):
        if node.returncode != 0:
            pytest.fail(f"node {i} exited with {node.returncode}:\n{logs[i][-6000:]}")
    report = json.loads(out.read_text())
    assert report["hpz"]["nodes"] == 2 and report["hpz"]["mesh"] == [2, 2]
    assert (report["mics"]["shard_group"], report["mics"]["replicas"]) == (2, 2)
    for name in ("hpz", "mics"):
        assert report[name]["diff"] <= 1e-5, (name, report[name])
    assert report["zeropp"]["loss_gap"] < 0.02, report["zeropp"]
    assert report["zeropp"]["cross_node_bytes"] < 0.5 * report["hpz"]["cross_node_bytes"]  # int8 gathers, int4 grads
