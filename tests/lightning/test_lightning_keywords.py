"""DeepSpeedStrategy's keyword arguments on ZeroStrategy and ZeroFabricStrategy: each sets the same ZeroConfig
field as ``config=`` does, a contradiction with the config names both, and LightningCLI parses them; the resume= option checks its value."""

from __future__ import annotations

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lightning_zero
from lightning_zero import ZeroFabricStrategy, ZeroStrategy

KEYWORDS = dict(allgather_bucket_size=1000, reduce_bucket_size=2000, allgather_partitions=False,
                reduce_scatter=False, overlap_comm=False, contiguous_gradients=False, sub_group_size=4096,
                stage3_prefetch_bucket_size=300, stage3_param_persistence_threshold=0,
                stage3_model_persistence_threshold=77, max_live_parameters=5000, max_reuse_distance=6000,
                loss_scale=128.0, initial_scale_power=8, loss_scale_window=50, hysteresis=3, min_loss_scale=0.5)
# The same settings as a DeepSpeed config, the full form.
CONFIG = {"zero_optimization": {"stage": 3, "allgather_bucket_size": 1000, "reduce_bucket_size": 2000,
                                "allgather_partitions": False, "reduce_scatter": False, "overlap_comm": False,
                                "contiguous_gradients": False, "sub_group_size": 4096,
                                "stage3_prefetch_bucket_size": 300, "stage3_param_persistence_threshold": 0,
                                "stage3_model_persistence_threshold": 77, "stage3_max_live_parameters": 5000,
                                "stage3_max_reuse_distance": 6000},
          "fp16": {"loss_scale": 128.0, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3,
                   "min_loss_scale": 0.5}}


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_keywords_set_the_fields_config_sets(cls):
    by_keywords = cls(stage=3, **KEYWORDS).zero_config
    by_config = cls(config=CONFIG).zero_config
    assert by_keywords.to_dict() == by_config.to_dict()
    assert set(by_keywords.explicit_fields()) == set(by_config.explicit_fields()) - {"stage"}
    assert by_keywords.param_persistence_threshold == 0 and by_keywords.fp16.loss_scale == 128.0
    plain = cls(stage=3, param_persistence_threshold=0, prefetch_bucket_size=300).zero_config
    assert plain.param_persistence_threshold == 0 and plain.prefetch_bucket_size == 300


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_keyword_and_config_must_agree(cls):
    with pytest.raises(ValueError, match=r"reduce_bucket_size=20\).*zero_optimization.reduce_bucket_size=10"):
        cls(config={"reduce_bucket_size": 10}, reduce_bucket_size=20)
    with pytest.raises(ValueError, match=r"loss_scale=64.0\).*fp16.loss_scale=128.0"):
        cls(config={"fp16": {"loss_scale": 128}}, loss_scale=64.0)
    agreed = cls(config={"reduce_bucket_size": 10, "fp16": {"enabled": "auto"}}, reduce_bucket_size=10,
                 loss_scale=64.0).zero_config
    assert agreed.reduce_bucket_size == 10 and agreed.fp16.loss_scale == 64.0
    kept = cls(config={"reduce_bucket_size": 10}, allgather_bucket_size=30).zero_config
    assert (kept.reduce_bucket_size, kept.allgather_bucket_size) == (10, 30)


def test_bad_keywords_raise_naming_the_field():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroStrategy(reduce_bucket_size=-1)
    with pytest.raises(ValueError, match="param_persistence_threshold"):
        ZeroStrategy(param_persistence_threshold=1, stage3_param_persistence_threshold=2)
    with pytest.raises(ValueError, match="overlap_comm"):
        ZeroStrategy(overlap_comm="yes")


def test_lightning_cli_parses_the_keywords():
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.strategy=lightning_zero.ZeroStrategy", "--trainer.strategy.stage=3",
        "--trainer.strategy.stage3_param_persistence_threshold=0", "--trainer.strategy.reduce_bucket_size=5000",
        "--trainer.strategy.overlap_comm=false"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroStrategy)
    config = strategy.zero_config
    assert (config.param_persistence_threshold, config.reduce_bucket_size, config.overlap_comm) == (0, 5000, False)


def test_resume_option_checks_what_it_is_given(tmp_path):
    from lightning_zero.checkpoint_io import newest_checkpoint

    with pytest.raises(TypeError, match="resume=3"):
        ZeroStrategy(resume=3)
    assert ZeroStrategy(resume=tmp_path).resume == str(tmp_path)
    with pytest.raises(ValueError, match="no ModelCheckpoint"):
        newest_checkpoint("latest", None)
    assert newest_checkpoint(str(tmp_path / "none-yet"), None) is None  # a first run starts fresh
