"""ZeroStrategy / ZeroFabricStrategy without launching processes: names, options, precision plugins, and the
errors that must name the option and the fix."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import DoublePrecision, TorchCheckpointIO
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import ZeroFabricStrategy, ZeroPrecision, ZeroStrategy
from lightning_zero.config import CONFIG_ENV_VAR, run_config


def cpu_trainer(strategy, **kwargs) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, **kwargs)


def test_import_registers_each_stage_once():
    importlib.reload(lightning_zero)  # importing twice is harmless
    for stage in (1, 2, 3):
        entry = StrategyRegistry[f"zero{stage}"]
        assert entry["strategy"] is ZeroStrategy and entry["init_params"] == {"stage": stage}


@pytest.mark.parametrize("strategy", ["zero3", ZeroStrategy(stage=3)])
def test_string_and_instance_give_the_same_strategy(strategy):
    trainer = cpu_trainer(strategy)
    assert type(trainer.strategy) is ZeroStrategy and trainer.strategy.stage == 3
    assert trainer.strategy.parallel_devices == [torch.device("cpu")] * 2
    assert trainer.strategy.is_distributed and trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2,
                                                                                                "rank": 0}


def test_checkpoint_io_plugin_reaches_named_strategy():
    io = TorchCheckpointIO()
    assert cpu_trainer("zero2", plugins=[io]).strategy.checkpoint_io is io


def test_config_from_json_yaml_env_and_defaults(tmp_path, monkeypatch):
    json_path = tmp_path / "ds.json"
    json_path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}))
    assert ZeroStrategy(config=str(json_path)).zero_config.reduce_bucket_size == 50_000_000
    yaml_path = tmp_path / "zero.yaml"
    yaml_path.write_text("stage3_prefetch_bucket_size: 1000\n")
    monkeypatch.setenv(CONFIG_ENV_VAR, str(yaml_path))
    from_env = ZeroStrategy()
    assert from_env.stage == 3 and from_env.zero_config.prefetch_bucket_size == 1000
    monkeypatch.delenv(CONFIG_ENV_VAR)
    assert ZeroStrategy().stage == 3 and ZeroStrategy(config={"stage": 1}).stage == 1


def test_bad_configs_raise_naming_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ZeroStrategy(config=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="contradicts the config's zero_optimization.stage=2"):
        ZeroStrategy(stage=3, config={"stage": 2})
    with pytest.raises(ValueError, match="did you mean 'reduce_bucket_size'"):
        ZeroStrategy(config={"reduce_bucket_sise": 10})
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        ZeroStrategy(stage=0)
    with pytest.raises(ValueError, match="offload_param needs stage 3"):
        ZeroStrategy(stage=2, config={"offload_param": {"device": "cpu"}})


def test_run_config_takes_trainer_values_and_refuses_contradictions():
    base = ZeroStrategy(config={"fp16": {"enabled": "auto", "loss_scale_window": 10},
                                "gradient_accumulation_steps": "auto"}).zero_config
    resolved = run_config(base, "16-mixed", 4)
    assert resolved.fp16.enabled and resolved.fp16.loss_scale_window == 10 and resolved.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="fp16.enabled=true but the Trainer's precision is '32-true'"):
        run_config(ZeroStrategy(config={"fp16": {"enabled": True}}).zero_config, "32-true")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 but Trainer"):
        run_config(ZeroStrategy(config={"gradient_accumulation_steps": 2}).zero_config, "32-true", 1)


@pytest.mark.parametrize("flag", ["bf16-mixed", "bf16-true", "32-true"])
def test_precision_flags_become_zero_precision(flag):
    plugin = cpu_trainer("zero3", precision=flag).precision_plugin
    assert type(plugin) is ZeroPrecision and plugin.precision == flag


def test_fp16_on_cpu_needs_the_plugin():
    # Lightning itself rewrites precision="16-mixed" to bf16 on CPU before a strategy sees it.
    assert cpu_trainer("zero2", plugins=[ZeroPrecision("16-mixed")]).precision_plugin.precision == "16-mixed"
    assert Fabric(strategy="zero2", accelerator="cpu", devices=2, precision="bf16-true").strategy.precision.precision \
        == "bf16-true"


def test_plugins_that_cannot_work_raise():
    with pytest.raises(TypeError, match="cannot train with the DoublePrecision precision plugin"):
        cpu_trainer("zero3", plugins=[DoublePrecision()])
    with pytest.raises(ValueError, match="must be one of"):
        ZeroPrecision("64-true")


def test_spawn_launcher_rejected_where_it_gives_wrong_results():
    with pytest.raises(ValueError, match="start_method='spawn'.*stage 3.*start_method='popen'"):
        cpu_trainer(ZeroStrategy(stage=3, start_method="spawn"))
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        cpu_trainer(ZeroStrategy(stage=2, start_method="fork"), precision="bf16-mixed")
    assert cpu_trainer(ZeroStrategy(stage=2, start_method="spawn")).strategy.launcher is not None


def test_unsupported_accelerator_and_storage_options_raise(tmp_path):
    strategy = ZeroStrategy()
    strategy.accelerator = object()
    with pytest.raises(RuntimeError, match="CPUs \\(gloo\\) or CUDA GPUs"):
        strategy.setup_environment()
    with pytest.raises(TypeError, match="storage_options"):
        ZeroStrategy().save_checkpoint({}, tmp_path / "x", storage_options={"a": 1})
    with pytest.raises(FileNotFoundError, match="not a ZeRO checkpoint"):
        ZeroStrategy().load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a ZeRO checkpoint"):
        lightning_zero.convert_to_single_file(tmp_path, tmp_path / "out.ckpt")


def test_single_file_optimizer_state_count_and_absence():
    from lightning_zero.checkpoint_io import _optimizer_states

    with pytest.warns(UserWarning, match="holds no optimizer state, so only the weights are restored"):
        assert _optimizer_states({"state_dict": {}}, optimizer_count=1) is None
    with pytest.raises(RuntimeError, match="configured 1 optimizers but the checkpoint contains 2 optimizers"):
        _optimizer_states({"optimizer_states": [{}, {}]}, optimizer_count=1)
    assert _optimizer_states({"optimizer_states": [{}, {"state": {}}]}, optimizer_count=2) == [{}, {"state": {}}]
    assert _optimizer_states({"optimizer_states": [{"state": {}}]}, optimizer_count=None) is None


def test_fabric_names_and_joint_setup():
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is ZeroFabricStrategy and fabric.strategy.stage == 3
    with pytest.raises(NotImplementedError, match="jointly"):
        fabric.strategy.setup_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
