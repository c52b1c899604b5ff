"""zero.yaml's Accelerate-named offload keys (offload_optimizer_device, ...) become the zero_optimization block's."""

import json

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
