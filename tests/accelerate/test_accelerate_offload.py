"""zero.yaml's Accelerate-named offload keys (offload_optimizer_device, ...) become the zero_optimization block's,
and through a real ``accelerate-zero launch`` (2 processes) the example trains with them to DDP's weights."""

import json
import sys

import pytest

from accelerate_zero import ZeroPlugin
from accelerate_zero.launch_config import read_launch_config, worker_environment


def _write(tmp_path, text):
    path = tmp_path / "zero.yaml"
    path.write_text(text)
    return path


def test_accelerate_offload_keys_reach_the_workers(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_ZERO_CONFIG_FILE", raising=False)
    launch = read_launch_config(_write(tmp_path, (
        "num_processes: 2\noffload_optimizer_device: nvme\noffload_optimizer_nvme_path: /local_nvme\n"
        "offload_param_device: cpu\nzero_optimization: {stage: 3, offload_optimizer: {pin_memory: true}}\n")))
    assert launch.zero == {"stage": 3, "offload_optimizer": {"pin_memory": True, "device": "nvme",
                                                             "nvme_path": "/local_nvme"},
                           "offload_param": {"device": "cpu"}}
    assert "offload_optimizer_device" not in launch.accelerate
    plugin = ZeroPlugin.from_env(worker_environment(launch))
    assert json.loads(worker_environment(launch)["ACCELERATE_ZERO_CONFIG"]) == launch.zero
    assert plugin.config.offload_optimizer.device == "nvme" and plugin.config.offload_param.device == "cpu"


@pytest.mark.parametrize("text, words", [
    ("offload_optimizer_device: cpu\nzero_optimization: {stage: 2, offload_optimizer: {device: nvme}}\n",
     "offload_optimizer_device: 'cpu' contradicts zero_optimization.offload_optimizer.device"),
    ("offload_param_device: cpu\nzero_optimization: {stage: 2}\n", "offload_param needs stage 3"),
    ("offload_optimizer_device: gpu\nzero_optimization: {stage: 2}\n", "offload_optimizer.device must be one of"),
])
def test_accelerate_offload_key_errors(tmp_path, text, words):
    with pytest.raises(Exception, match=words):
        read_launch_config(_write(tmp_path, text))


def test_launch_with_offload_keys_trains_to_ddps_weights(tmp_path):
    """zero.yaml puts the optimizer and the parameter shards on NVMe with Accelerate's key names; the launched
    example (accelerate/scripts/offload.py) ends within 1e-5 of plain Accelerate DDP, with the placement asked
    for; the engine's swap files are gone after end_training(), and every swap file once the processes exit."""
    from accelerate_runs import SCRIPTS, TOLERANCE, ZERO_YAML, clean_env, max_diff, run

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (tmp_path / "zero.yaml").write_text(ZERO_YAML.replace("  stage: 2\n", "  stage: 3\n  param_persistence_threshold: 0\n"
                                                          "  offload_param: {max_in_cpu: 0}\n")
                                        + f"offload_optimizer_device: nvme\noffload_optimizer_nvme_path: {nvme}\n"
                                        f"offload_param_device: nvme\noffload_param_nvme_path: {nvme}\n")
    run([sys.executable, "-m", "accelerate_zero", "launch", "--config", tmp_path / "zero.yaml",
         SCRIPTS / "offload.py", tmp_path / "out.json"], cwd=tmp_path, env=clean_env(OFFLOAD_TEST_NVME=str(nvme)))
    results = json.loads((tmp_path / "out.json").read_text())
    assert max_diff(results["offload"]["weights"], results["ddp"]["weights"]) <= TOLERANCE
    assert max(abs(a - b) for a, b in zip(results["offload"]["norms"], results["ddp"]["norms"])) <= TOLERANCE
    placement = results["placement"]
    assert placement["optimizer"] == "nvme" and placement["param_units_in_file"] > 0, placement
    # (the training run's engine and this one: each rank holds an optimizer file and a parameter file per engine)
    assert sorted({name.rsplit("_", 2)[0] for name in placement["files"]}) == [
        "zero_offload_rank0", "zero_offload_rank1", "zero_params_rank0", "zero_params_rank1"], placement
    assert results["files_after_end_training"] == [], results["files_after_end_training"]
    assert list(nvme.iterdir()) == []
