"""Two nodes as two real launcher invocations on localhost (gloo): ``torchrun --nnodes 2 --node-rank i`` and
``accelerate launch --num_machines 2 --machine_rank i``.

The engine must find the nodes from the launcher's environment alone, and train like DDP under hpZ and MiCS
(and close to it under full ZeRO++). The scripts are tests/core_scripts/two_nodes.py and
tests/accelerate_scripts/two_machines.py. (Lightning's ``num_nodes=2``: tests/test_lightning_multinode.py.)
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


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "GROUP_", "WORLD_", "MASTER_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _run_nodes(commands: list, cwd, env: dict) -> None:
    """Start one launcher per node (in ``cwd``, or ``cwd[i]``), wait for all (killing them after TIMEOUT_S), fail
    with the log of a bad one."""
    cwds = cwd if isinstance(cwd, list) else [cwd] * len(commands)
    nodes = [subprocess.Popen(command, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for command, where in zip(commands, cwds)]
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


def test_torchrun_two_nodes_on_localhost(tmp_path):
    out, port = tmp_path / "report.json", _free_port()
    _run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT),
                 str(out)] for i in range(2)], tmp_path, _clean_env())
    report = json.loads(out.read_text())
    assert report["hpz"]["nodes"] == 2 and report["hpz"]["mesh"] == [2, 2]
    assert (report["mics"]["shard_group"], report["mics"]["replicas"]) == (2, 2)
    for name in ("hpz", "mics"):
        assert report[name]["diff"] <= 1e-5, (name, report[name])
    assert report["zeropp"]["loss_gap"] < 0.02, report["zeropp"]
    assert report["zeropp"]["cross_node_bytes"] < 0.5 * report["hpz"]["cross_node_bytes"]  # int8 gathers, int4 grads


def test_accelerate_launch_two_machines_on_localhost(tmp_path):
    out, port = tmp_path / "report.json", _free_port()
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n")
    script = ROOT / "tests" / "accelerate_scripts" / "two_machines.py"
    env = {**_clean_env(), "ACCELERATE_USE_CPU": "true"}
    _run_nodes([[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                 "--num_machines", "2", "--machine_rank", str(i), "--num_processes", "4",
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), str(script), str(out)]
                for i in range(2)], tmp_path, env)
    report = json.loads(out.read_text())
    ddp = report["ddp"]["weights"]
    for name in ("mics", "hpz"):
        assert report[name]["nodes"] == 2 and report[name]["cross_node_bytes"] > 0, report[name]
        diff = max(abs(a - b) for key in ddp for a, b in zip(report[name]["weights"][key], ddp[key]))
        assert diff <= 1e-5, (name, diff)
    assert report["mics"]["replicas"] == 2


def test_accelerate_node_local_save_state_resumes_on_two_machines(tmp_path):
    """``checkpoint.use_node_local_storage`` through ``save_state``/``load_state``: each machine (its own working
    directory, the same relative path) holds its ranks' shards with its own manifest, and Accelerate's files
    (``save_on_each_node``); resuming ends like the uninterrupted run."""
    port = _free_port()
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n")
    script = ROOT / "tests" / "accelerate_scripts" / "node_local_state.py"
    machines = [tmp_path / f"machine{i}" for i in range(2)]
    for directory in machines:
        directory.mkdir()
    env = {**_clean_env(), "ACCELERATE_USE_CPU": "true"}
    _run_nodes([[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                 "--num_machines", "2", "--machine_rank", str(i), "--num_processes", "4",
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), str(script), str(tmp_path)]
                for i in range(2)], machines, env)
    weights = json.loads((tmp_path / "weights.json").read_text())
    straight, resumed = weights["straight"], weights["resumed"]
    diff = max(abs(a - b) for key in straight for a, b in zip(straight[key], resumed[key]))
    assert diff <= 1e-6, diff
    for machine in range(2):
        report = json.loads((tmp_path / f"machine{machine}.json").read_text())
        shards = [name for name in report["zero_files"] if name.startswith("shard-")]
        assert shards == [f"shard-0000{r}-of-00004.safetensors" for r in (2 * machine, 2 * machine + 1)], report
        assert (report["node_local"]["node"], report["node_local"]["nodes"]) == (machine, 2), report
        assert "zero_state.json" in report["files"], report
