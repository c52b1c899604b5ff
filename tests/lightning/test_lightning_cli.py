"""LightningCLI: the example with its YAML config (class-path strategy) trains on 2 processes; the string form
``--trainer.strategy=zero3`` resolves; ``--print_config`` output parses back to the same config."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import lightning_zero
from lightning_runs import REPO, run

EXAMPLE = REPO / "examples" / "lightning_gpt.py"
YAML = REPO / "examples" / "lightning_cli.yaml"
TINY = ["--model.n_layer", "1", "--model.n_embd", "32", "--data.train_samples", "256", "--data.val_samples", "64",
        "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lightning_gpt_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(200)
def test_example_with_yaml_config_trains_checkpoints_and_exports(tmp_path, example):
    run(str(EXAMPLE), "fit", "--config", str(YAML), *TINY, timeout=180, cwd=tmp_path)
    root = tmp_path / "lightning_gpt"
    index = root / "model-bf16" / "model.safetensors.index.json"
    assert index.is_file() and '"dtype": "bf16"' in index.read_text()
    last = root / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and (last / "manifest.json").is_file()
    single = lightning_zero.convert_to_single_file(last, tmp_path / "last.ckpt")
    model = example.LitGPT.load_from_checkpoint(single)
    assert model.hparams.n_layer == 1 and model.gpt.blocks[0].qkv.weight.dtype == torch.float32
    assert torch.isfinite(model.gpt.tok.weight).all()


def _printed(example, capsys, *args) -> str:
    with pytest.raises(SystemExit):
        example.main(["fit", *args, "--print_config"])
    return capsys.readouterr().out


@pytest.mark.parametrize("args", [["--config", str(YAML)], ["--trainer.strategy=zero3"]])
def test_print_config_round_trips(tmp_path, example, capsys, args):
    printed = _printed(example, capsys, *args)
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert _printed(example, capsys, "--config", str(saved)) == printed


def test_string_and_class_path_forms_build_zero_strategy(example):
    from lightning.pytorch.cli import LightningCLI

    by_name = LightningCLI(example.LitGPT, example.AdditionData, run=False,
                           args=["--trainer.strategy=zero2", "--trainer.accelerator=cpu", "--trainer.devices=2"])
    assert isinstance(by_name.trainer.strategy, lightning_zero.ZeroStrategy) and by_name.trainer.strategy.stage == 2
    by_path = example.GPTCLI(example.LitGPT, example.AdditionData, run=False, args=["--config", str(YAML)])
    strategy = by_path.trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy) and strategy.stage == 3
    assert strategy.zero_config.gather_16bit_weights_on_model_save is True
    assert strategy.zero_config.param_persistence_threshold == 1000  # DeepSpeed's stage3_* alias was read
