"""Two nodes as two real launcher invocations on localhost (gloo): ``torchrun --nnodes 2 --node-rank i`` and
``accelerate launch --num_machines 2 --machine_rank i``.

The engine must find the nodes from the launcher's environment alone, and train like DDP under hpZ and MiCS
(and close to it under full ZeRO++). The scripts are tests/core/scripts/two_nodes.py and
tests/accelerate/scripts/two_machines.py. (Lightning's ``num_nodes=2``: tests/lightning/test_lightning_multinode.py.)
"""

import json
import sys

from launch import ACCELERATE_SCRIPTS, CORE_SCRIPTS, child_env, finish, free_port, start, stop

SCRIPT = CORE_SCRIPTS / "two_nodes.py"
TIMEOUT_S = 240


def _clean_env() -> dict:
    return {k: v for k, v in child_env().items() if not k.startswith("ACCELERATE_")}


def _run_nodes(commands: list, cwd, env: dict) -> None:
    """Start one launcher per node (in ``cwd``, or ``cwd[i]``), wait for all (killing them after TIMEOUT_S), fail
    with the log of a bad one."""
    cwds = cwd if isinstance(cwd, list) else [cwd] * len(commands)
    nodes = [start(command, env=env, cwd=where) for command, where in zip(commands, cwds)]
    try:
        for i, node in enumerate(nodes):
            finish(node, TIMEOUT_S, f"node {i}")
    finally:
        for node in nodes:  # the other node, after one failed
            stop(node)


def test_torchrun_two_nodes_on_localhost(tmp_path):
    out, port = tmp_path / "report.json", free_port()
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
    out, port = tmp_path / "report.json", free_port()
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n")
    script = ACCELERATE_SCRIPTS / "two_machines.py"
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
    port = free_port()
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: 'no'\n")
    script = ACCELERATE_SCRIPTS / "node_local_state.py"
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
