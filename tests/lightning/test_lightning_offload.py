"""Lightning's offload names and ZeroStrategy's offload arguments become the config's offload blocks."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero  # noqa: F401  (registers the names)
from lightning_zero import ZeroStrategy


@pytest.mark.parametrize("name, stage, optimizer_device, param_device", [
    ("zero2_offload", 2, "cpu", None),
    ("zero3_offload", 3, "cpu", "cpu"),
    ("zero3_offload_nvme", 3, "nvme", "nvme"),
])
def test_registered_offload_names(name, stage, optimizer_device, param_device):
    entry = StrategyRegistry[name]
    strategy = entry["strategy"](**entry["init_params"])
    config = strategy.zero_config
    assert isinstance(strategy, ZeroStrategy) and config.stage == stage
    assert config.offload_optimizer.device == optimizer_device
    assert (config.offload_param.device if config.offload_param else None) == param_device
    if optimizer_device == "nvme":
        assert config.offload_optimizer.nvme_path == "/local_nvme"


def test_offload_arguments(tmp_path):
    config = ZeroStrategy(stage=2, offload_optimizer=True).zero_config
    assert config.offload_optimizer.device == "cpu" and config.offload_param is None
    config = ZeroStrategy(stage=1, offload_optimizer=True, nvme_path=str(tmp_path)).zero_config
    assert (config.offload_optimizer.device, config.offload_optimizer.nvme_path) == ("nvme", str(tmp_path))
    config = ZeroStrategy(config={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                         "pin_memory": True}}}
                          ).zero_config
    assert config.offload_optimizer.pin_memory  # no argument: the config's own block stays
    config = ZeroStrategy(stage=3, config={"zero_optimization": {"stage": 3, "offload_param": {"max_in_cpu": 0,
                                                                                             "buffer_count": 2}}},
                          offload_parameters="nvme", nvme_path=str(tmp_path)).zero_config
    param = config.offload_param  # an argument sets the device and path; the block's other fields stay
    assert (param.device, param.nvme_path, param.max_in_cpu, param.buffer_count) == ("nvme", str(tmp_path), 0, 2)
    assert "offload_optimizer" not in ZeroStrategy(stage=2, offload_optimizer=True).zero_config.unimplemented_fields()
    with pytest.raises(ValueError, match=r"ZeroStrategy\(offload_optimizer='gpu'\)"):
        ZeroStrategy(stage=2, offload_optimizer="gpu")
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        ZeroStrategy(stage=2, offload_parameters=True)
