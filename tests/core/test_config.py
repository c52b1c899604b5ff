"""Tests for zero_core.config: DeepSpeed names and defaults, every way in, errors, "auto", status."""

import ast
import contextlib
import copy
import dataclasses
import json
import pathlib
import pickle
import re
import sys
import warnings

import pytest
import torch
import yaml

import zero_core.config
from zero_core.config import (
    FIELD_STATUS,
    BF16Config,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
    ZeroConfigError,
    field_paths,
    markdown_tables,
)
from zero_core.config.deepspeed import ALIASES, DEEPSPEED_IGNORED_KEYS, RUN_FIELDS

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"

# Defaults copied from DeepSpeed's DeepSpeedZeroConfig documentation (the seed), not from our code.
DEEPSPEED_ZERO_DEFAULTS = {
    "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
    "allgather_partitions": True, "allgather_bucket_size": 500_000_000, "overlap_comm": None,
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "offload_param": None,
    "offload_optimizer": None, "sub_group_size": 1_000_000_000, "prefetch_bucket_size": 50_000_000,
    "param_persistence_threshold": 100_000, "model_persistence_threshold": sys.maxsize,
    "max_live_parameters": 1_000_000_000, "max_reuse_distance": 1_000_000_000,
    "gather_16bit_weights_on_model_save": False, "ignore_unused_parameters": True, "legacy_stage1": False,
    "round_robin_gradients": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False, "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False, "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False, "override_module_apply": True,
}
DEEPSPEED_OFFLOAD_PARAM_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 5,
                                    "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000, "pin_memory": False}
DEEPSPEED_OFFLOAD_OPTIMIZER_DEFAULTS = {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": False,
                                        "pipeline_read": False, "pipeline_write": False, "fast_init": False}
AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True}
# DeepSpeed's checkpoint block (its parallel_write sub-block is not accepted: no pipeline parallelism here).
CHECKPOINT_DEFAULTS = {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False}
# DeepSpeed's DeepSpeedZeroLeafModuleConfig (zero_optimization.leaf_module, after override_module_apply).
DEEPSPEED_LEAF_MODULE_DEFAULTS = {
    "classes": ["transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock"],
    "names": [], "name_suffixes": []}
FP16_DEFAULTS = {"enabled": False, "auto_cast": False, "loss_scale": 0.0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1.0}

# A non-default value for every ZeroConfig field, with whatever other keys that value needs.
NON_DEFAULT = {
    "stage": (2, {}), "contiguous_gradients": (False, {}), "reduce_scatter": (False, {}),
    "reduce_bucket_size": (1234, {}), "allgather_partitions": (False, {}), "allgather_bucket_size": (4321, {}),
    "overlap_comm": (True, {}), "load_from_fp32_weights": (False, {}), "elastic_checkpoint": (True, {}),
    "offload_param": ({"device": "cpu"}, {"stage": 3}), "offload_optimizer": ({"device": "cpu"}, {"stage": 2}),
    "sub_group_size": (77, {}), "prefetch_bucket_size": (11, {}), "param_persistence_threshold": (12, {}),
    "model_persistence_threshold": (13, {}), "max_live_parameters": (14, {}), "max_reuse_distance": (15, {}),
    "gather_16bit_weights_on_model_save": (True, {}), "ignore_unused_parameters": (False, {}),
    "legacy_stage1": (True, {}), "round_robin_gradients": (True, {}), "zero_hpz_partition_size": (8, {"stage": 3}),
    "zero_quantized_weights": (True, {"stage": 3}), "zero_quantized_nontrainable_weights": (True, {"stage": 3}),
    "zero_quantized_gradients": (True, {"stage": 3}), "mics_shard_size": (8, {}), "mics_hierarchical_params_gather": (True, {}),
    "memory_efficient_linear": (False, {}), "pipeline_loading_checkpoint": (True, {}),
    "override_module_apply": (False, {}), "leaf_module": ({"names": ["layers.0.moe"]}, {}),
    "shard_alignment": (64, {}), "generation_max_live_parameters": (1000, {}),
    "weights_ema_decay": (0.99, {}),
    "fp16": ({"enabled": True}, {}), "bf16": ({"enabled": True}, {}),
    "gradient_clipping": (1.5, {}), "gradient_accumulation_steps": (4, {}), "aio": ({"block_size": 4096}, {}),
    "checkpoint": ({"use_node_local_storage": True}, {}),
    "activation_checkpointing": ({"cpu_checkpointing": True}, {}),
}


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _field_value(cfg, name):
    value = _plain(getattr(cfg, name))
    return {k: v for k, v in value.items() if k in NON_DEFAULT[name][0]} if isinstance(value, dict) else value


@contextlib.contextmanager
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ----------------------------------------------------------------------------- defaults and fields


def test_defaults_equal_deepspeed():
    cfg = ZeroConfig()
    assert {k: getattr(cfg, k) for k in DEEPSPEED_ZERO_DEFAULTS} == DEEPSPEED_ZERO_DEFAULTS
    assert dataclasses.asdict(OffloadParamConfig()) == DEEPSPEED_OFFLOAD_PARAM_DEFAULTS
    assert dataclasses.asdict(OffloadOptimizerConfig()) == {**DEEPSPEED_OFFLOAD_OPTIMIZER_DEFAULTS,
                                                            **OWN_OFFLOAD_OPTIMIZER_DEFAULTS}
    assert dataclasses.asdict(cfg.leaf_module) == DEEPSPEED_LEAF_MODULE_DEFAULTS
    assert dataclasses.asdict(cfg.fp16) == FP16_DEFAULTS
    assert dataclasses.asdict(cfg.bf16) == {"enabled": False}
    assert (cfg.gradient_clipping, cfg.gradient_accumulation_steps) == (0.0, 1)
    assert dataclasses.asdict(cfg.aio) == AIO_DEFAULTS
    assert dataclasses.asdict(cfg.checkpoint) == CHECKPOINT_DEFAULTS


# Fields of lightning-zero's own in the offload_optimizer block (DeepSpeed has none of these), with defaults.
OWN_OFFLOAD_OPTIMIZER_DEFAULTS = {"delayed_update_after": None, "overlap_with_forward": None,
                                  "overlap_with_backward": False, "host_kernel": "fused"}


# Fields of lightning-zero's own in the zero_optimization block (DeepSpeed has none of these), with defaults.
OWN_ZERO_DEFAULTS = {"shard_alignment": None, "generation_max_live_parameters": None,
                     "weights_ema_decay": None}


def test_fields_are_deepspeed_fields_plus_run_fields():
    names = [f.name for f in dataclasses.fields(ZeroConfig)]
    assert names == [*DEEPSPEED_ZERO_DEFAULTS, "leaf_module", *OWN_ZERO_DEFAULTS, *RUN_FIELDS]
    assert {k: getattr(ZeroConfig(), k) for k in OWN_ZERO_DEFAULTS} == OWN_ZERO_DEFAULTS
    assert set(NON_DEFAULT) == set(names)


@pytest.mark.parametrize("name", list(NON_DEFAULT))
def test_every_field_from_kwargs_dict_and_whole_config(name):
    value, extra = NON_DEFAULT[name]
    by_kwargs = ZeroConfig(**extra, **{name: value})
    by_dict = ZeroConfig.from_dict({**extra, name: value})
    whole = {"zero_optimization": dict(extra)}
    (whole if name in RUN_FIELDS else whole["zero_optimization"])[name] = value
    by_whole = ZeroConfig.from_dict(whole)
    assert _field_value(by_kwargs, name) == value
    assert by_kwargs == by_dict == by_whole
    assert name in by_kwargs.explicit_fields()


@pytest.mark.parametrize(("block", "cls", "values"), [
    ("offload_param", OffloadParamConfig, {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 1,
                                           "buffer_size": 2, "max_in_cpu": 3, "pin_memory": True}),
    ("offload_optimizer", OffloadOptimizerConfig, {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 1,
                                                   "pin_memory": True, "pipeline_read": True,
                                                   "pipeline_write": True, "fast_init": True,
                                                   "delayed_update_after": None, "overlap_with_forward": True,
                                                   "overlap_with_backward": False, "host_kernel": "fused"}),
    ("offload_optimizer", OffloadOptimizerConfig, {"device": "cpu", "nvme_path": None, "buffer_count": 4,
                                                   "pin_memory": False, "pipeline_read": False,
                                                   "pipeline_write": False, "fast_init": False,
                                                   "delayed_update_after": 3, "overlap_with_forward": False,
                                                   "overlap_with_backward": True, "host_kernel": "fused"}),
    ("fp16", FP16Config, {"enabled": True, "auto_cast": True, "loss_scale": 128.0, "initial_scale_power": 8,
                          "loss_scale_window": 10, "hysteresis": 3, "consecutive_hysteresis": True,
                          "min_loss_scale": 0.5}),
    ("bf16", BF16Config, {"enabled": True}),
    ("leaf_module", LeafModuleConfig, {"classes": ["MyMoeBlock"], "names": ["layers.0.moe"],
                                       "name_suffixes": [".moe"]}),
])
def test_every_nested_field(block, cls, values):
    cfg = ZeroConfig.from_dict({"stage": 3, block: values})
    assert isinstance(getattr(cfg, block), cls)
    assert dataclasses.asdict(getattr(cfg, block)) == values
    assert ZeroConfig(stage=3, **{block: cls(**values)}) == cfg


@pytest.mark.parametrize(("alias", "name"), list(ALIASES.items()))
def test_alias_maps_to_field(alias, name):
    value = {"enabled": True} if name == "bf16" else (True if name.startswith("gather") else 99)
    expected = ZeroConfig(**{name: value})
    with _no_warnings():
        assert ZeroConfig.from_dict({alias: value}) == expected
        assert ZeroConfig(**{alias: value}) == expected
    assert name in ZeroConfig(**{alias: value}).explicit_fields()


def test_alias_in_whole_config():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage3_max_live_parameters": 5},
                                "bfloat16": {"enabled": True}})
    assert (cfg.max_live_parameters, cfg.bf16.enabled) == (5, True)


def test_floats_with_integral_values_are_ints():
    cfg = ZeroConfig.from_dict({"reduce_bucket_size": 5e8, "stage": 2.0, "fp16": {"hysteresis": 4.0}})
    assert cfg.reduce_bucket_size == 500_000_000 and type(cfg.reduce_bucket_size) is int
    assert type(cfg.stage) is int and type(cfg.fp16.hysteresis) is int
    assert type(ZeroConfig(gradient_clipping=1).gradient_clipping) is float


def test_nvme_path_accepts_pathlike():
    cfg = ZeroConfig(stage=3, offload_param={"device": "nvme", "nvme_path": pathlib.Path("/nvme")})
    assert cfg.offload_param.nvme_path == "/nvme"


# ----------------------------------------------------------------------------- deprecated names


@pytest.mark.parametrize(("given", "new", "check"), [
    ({"stage": 1, "cpu_offload": True}, "zero_optimization.offload_optimizer",
     lambda c: c.offload_optimizer == OffloadOptimizerConfig(device="cpu")),
    ({"cpu_offload": False}, "zero_optimization.offload_optimizer", lambda c: c.offload_optimizer is None),
    ({"stage": 3, "cpu_offload_param": True}, "zero_optimization.offload_param",
     lambda c: c.offload_param == OffloadParamConfig(device="cpu")),
    ({"stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True},
     "pin_memory", lambda c: c.offload_param.pin_memory and c.offload_optimizer.pin_memory),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}, "cpu_offload_use_pin_memory": True},
     "pin_memory", lambda c: c.offload_optimizer.pin_memory is False),
    ({"stage": 2, "offload_optimizer": OffloadOptimizerConfig(device="cpu"), "cpu_offload_use_pin_memory": True},
     "pin_memory", lambda c: c.offload_optimizer.pin_memory is True),
    ({"cpu_offload_use_pin_memory": True}, "no offload block is set",
     lambda c: c.offload_param is None and c.offload_optimizer is None),
    ({"stage3_gather_fp16_weights_on_model_save": True}, "zero_optimization.gather_16bit_weights_on_model_save",
     lambda c: c.gather_16bit_weights_on_model_save is True),
])
def test_deprecated_name_maps_and_warns(given, new, check):
    for build in (lambda: ZeroConfig.from_dict(given), lambda: ZeroConfig(**given),
                  lambda: ZeroConfig.from_dict({"zero_optimization": given})):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            cfg = build()
        assert check(cfg)
        assert record and all(w.category is FutureWarning for w in record)
        assert any(re.search(r"is deprecated; use .*" + re.escape(new), str(w.message)) for w in record)
        assert {w.filename for w in record} == {__file__}  # warnings point at the caller, not into zero_core.config


def test_deprecated_names_count_as_explicit():
    with pytest.warns(FutureWarning):
        cfg = ZeroConfig(cpu_offload=True, stage=1)
    assert cfg.explicit_fields() == ("stage", "offload_optimizer")


# ----------------------------------------------------------------------------- files


HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

WHOLE = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR"},
    "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True},
    "bfloat16": {"enabled": True}, "gradient_clipping": 1.0, "gradient_accumulation_steps": 8,
}


def test_json_file(tmp_path):
    path = tmp_path / "zero.json"
    path.write_text('{"stage": 1, "reduce_bucket_size": 5e8}')
    assert ZeroConfig.from_file(path) == ZeroConfig(stage=1)
    assert ZeroConfig.from_file(str(path)).stage == 1


def test_yaml_file_reads_5e8_as_a_number(tmp_path):
    path = tmp_path / "zero.yaml"
    path.write_text("stage: 3\nreduce_bucket_size: 5e8\nprefetch_bucket_size: 1.0e+3\noverlap_comm: false\n")
    cfg = ZeroConfig.from_file(path)
    got = (cfg.stage, cfg.reduce_bucket_size, cfg.prefetch_bucket_size, cfg.overlap_comm)
    assert got == (3, 500_000_000, 1000, False)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_whole_deepspeed_file(tmp_path, suffix):
    path = tmp_path / f"ds_config{suffix}"
    path.write_text(json.dumps(WHOLE) if suffix == ".json" else yaml.safe_dump(WHOLE))
    cfg = ZeroConfig.from_file(path)
    assert (cfg.stage, cfg.reduce_bucket_size, cfg.overlap_comm) == (2, 500_000_000, True)
    assert cfg.bf16.enabled and not cfg.fp16.enabled and cfg.param_dtype == torch.bfloat16
    assert (cfg.gradient_clipping, cfg.gradient_accumulation_steps) == (1.0, 8)


def test_whole_config_with_fp16_and_bf16_key():
    cfg = ZeroConfig.from_dict({**WHOLE, "bfloat16": {"enabled": False}, "fp16": {"enabled": True,
                                                                                 "loss_scale_window": 50}})
    assert cfg.fp16 == FP16Config(enabled=True, loss_scale_window=50) and cfg.param_dtype == torch.float16
    assert ZeroConfig.from_dict({"zero_optimization": None}) == ZeroConfig()


def test_whole_config_without_zero_block():
    cfg = ZeroConfig.from_dict({"train_batch_size": 8, "optimizer": {"type": "Adam"}, "fp16": {"enabled": True}})
    assert cfg == ZeroConfig(fp16={"enabled": True})
    with pytest.raises(ZeroConfigError, match="'stage': it belongs inside 'zero_optimization'"):
        ZeroConfig.from_dict({"stage": 2, "optimizer": {"type": "Adam"}})


def test_ignored_keys_are_known_deepspeed_keys():
    assert {"optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
            "wall_clock_breakdown", "zero_allow_untested_optimizer"} <= DEEPSPEED_IGNORED_KEYS
    cfg = ZeroConfig.from_dict({"zero_optimization": {}, **{key: {} for key in DEEPSPEED_IGNORED_KEYS}})
    assert cfg == ZeroConfig()


# ----------------------------------------------------------------------------- round trip and coerce


def _busy_config():
    return ZeroConfig(stage=3, offload_param={"device": "nvme", "nvme_path": "/nvme"}, overlap_comm=False,
                      offload_optimizer={"device": "cpu", "pin_memory": True}, mics_shard_size=4,
                      fp16={"enabled": True, "loss_scale": 8.0}, gradient_clipping=0.5,
                      gradient_accumulation_steps=2)


@pytest.mark.parametrize("cfg", [ZeroConfig(), _busy_config(), ZeroConfig(bf16={"enabled": True})])
def test_to_dict_round_trip(cfg):
    d = cfg.to_dict()
    assert set(d) == {"zero_optimization", *RUN_FIELDS}
    assert ZeroConfig.from_dict(d) == cfg
    assert ZeroConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_to_dict_shape():
    d = _busy_config().to_dict()
    assert d["zero_optimization"]["offload_param"]["nvme_path"] == "/nvme"
    assert d["fp16"]["loss_scale"] == 8.0 and d["gradient_accumulation_steps"] == 2


def test_coerce_each_accepted_type(tmp_path):
    cfg = ZeroConfig(stage=2)
    path = tmp_path / "c.yml"
    path.write_text("stage: 2\n")
    assert ZeroConfig.coerce(cfg) is cfg
    assert ZeroConfig.coerce({"stage": 2}) == cfg
    assert ZeroConfig.coerce(cfg.to_dict()) == cfg
    assert ZeroConfig.coerce(str(path)) == cfg
    assert ZeroConfig.coerce(path) == cfg
    assert ZeroConfig.coerce(None) == ZeroConfig()


@pytest.mark.parametrize("bad", [3, [("stage", 2)], b"zero.json", 1.5])
def test_coerce_rejects_other_types(bad):
    with pytest.raises(TypeError, match=r"config must be a ZeroConfig, a dict .*a path .*or None, got"):
        ZeroConfig.coerce(bad)


def test_derived_values():
    assert ZeroConfig(stage=3).resolved_overlap_comm is True
    assert ZeroConfig(stage=2).resolved_overlap_comm is False
    assert ZeroConfig(stage=3, overlap_comm=False).resolved_overlap_comm is False
    assert ZeroConfig(stage=1, overlap_comm=True).resolved_overlap_comm is True
    assert ZeroConfig().param_dtype == torch.float32
    assert ZeroConfig(fp16={"enabled": True}).param_dtype == torch.float16


def test_copy_and_pickle_keep_bookkeeping():
    cfg = ZeroConfig.from_dict({"stage": 2, "gradient_clipping": "auto"})
    for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert clone == cfg and clone.auto_fields == ("gradient_clipping",)
        assert clone.explicit_fields() == ("stage", "gradient_clipping")


def test_repr_and_eq_ignore_bookkeeping():
    a, b = ZeroConfig(stage=1), ZeroConfig.from_dict({"stage": 1, "reduce_bucket_size": "auto"})
    assert a == b and repr(a) == repr(b) and b.auto_fields == ("reduce_bucket_size",)


# ----------------------------------------------------------------------------- "auto"


def test_auto_fields_recorded_with_defaults_meanwhile():
    cfg = ZeroConfig.from_dict(HF_ZERO3)
    assert cfg.auto_fields == ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold",
                               "fp16.enabled", "bf16.enabled", "gradient_clipping", "gradient_accumulation_steps")
    assert (cfg.reduce_bucket_size, cfg.fp16.enabled, cfg.gradient_clipping) == (500_000_000, False, 0.0)
    assert cfg.gather_16bit_weights_on_model_save and cfg.max_live_parameters == 1_000_000_000
    d = cfg.to_dict()
    assert d["zero_optimization"]["reduce_bucket_size"] == "auto" and d["fp16"]["enabled"] == "auto"
    assert ZeroConfig.from_dict(d).auto_fields == cfg.auto_fields


def test_resolve_auto_all_resolved_is_silent():
    cfg = ZeroConfig.from_dict(HF_ZERO3)
    with _no_warnings():
        out = cfg.resolve_auto(reduce_bucket_size=1000, stage3_prefetch_bucket_size=900,
                               gradient_accumulation_steps=4, gradient_clipping=1.0,
                               **{"zero_optimization.param_persistence_threshold": 10, "fp16.enabled": True,
                                  "bfloat16.enabled": False})
    assert out.auto_fields == () and cfg.auto_fields  # the original is untouched
    assert (out.reduce_bucket_size, out.prefetch_bucket_size, out.param_persistence_threshold) == (1000, 900, 10)
    assert (out.fp16.enabled, out.gradient_accumulation_steps, out.gradient_clipping) == (True, 4, 1.0)
    assert out.explicit_fields() == cfg.explicit_fields()


def test_resolve_auto_warns_once_for_unresolved():
    cfg = ZeroConfig.from_dict(HF_ZERO3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = cfg.resolve_auto(gradient_accumulation_steps=2, stage=1)  # stage is not "auto": ignored
    assert len(record) == 1 and record[0].category is UserWarning
    message = str(record[0].message)
    for path, default in [("reduce_bucket_size", 500000000), ("fp16.enabled", False), ("gradient_clipping", 0.0)]:
        assert f"{path}={default!r}" in message
    assert "gradient_accumulation_steps" not in message
    assert out.stage == 3 and out.gradient_accumulation_steps == 2 and out.auto_fields == ()


def test_auto_in_kwargs_and_offload_block():
    cfg = ZeroConfig(stage=2, offload_optimizer={"device": "auto"}, gradient_clipping="auto")
    assert cfg.auto_fields == ("offload_optimizer.device", "gradient_clipping")
    out = cfg.resolve_auto(**{"offload_optimizer.device": "cpu", "gradient_clipping": 2.0})
    assert out.offload_optimizer.device == "cpu" and out.gradient_clipping == 2.0


# ----------------------------------------------------------------------------- implementation status


def test_field_status_classification():
    honoured = {"stage", "reduce_scatter", "reduce_bucket_size", "allgather_partitions", "allgather_bucket_size",
                "overlap_comm", "ignore_unused_parameters", "fp16", "bf16", "gradient_clipping",
                "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                "max_live_parameters", "max_reuse_distance", "override_module_apply",
                "load_from_fp32_weights", "gather_16bit_weights_on_model_save", "offload_optimizer",
                "leaf_module", "offload_param", "zero_hpz_partition_size", "zero_quantized_weights",
                "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather", "checkpoint",
                "shard_alignment", "generation_max_live_parameters",
                "weights_ema_decay"}
    mapped = {"contiguous_gradients", "elastic_checkpoint", "gradient_accumulation_steps", "legacy_stage1",
              "sub_group_size", "memory_efficient_linear", "aio", "zero_quantized_nontrainable_weights",
              "activation_checkpointing"}
    assert list(FIELD_STATUS) == [f.name for f in dataclasses.fields(ZeroConfig)]
    assert {k for k, v in FIELD_STATUS.items() if v == "honoured"} == honoured
    assert {k for k, v in FIELD_STATUS.items() if v.startswith("mapped: ")} == mapped
    assert {k for k, v in FIELD_STATUS.items() if v == "not yet implemented"} == set(FIELD_STATUS) - honoured - mapped


def test_warn_unimplemented_lists_fields_once():
    cfg = ZeroConfig(stage=3, round_robin_gradients=True, pipeline_loading_checkpoint=True, reduce_bucket_size=10,
                     prefetch_bucket_size=50_000_000, contiguous_gradients=False,
                     offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    assert cfg.unimplemented_fields() == ("round_robin_gradients", "pipeline_loading_checkpoint")
    with pytest.warns(UserWarning) as record:
        cfg.warn_unimplemented()
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    assert "zero_optimization.round_robin_gradients (not yet implemented)" in message
    assert "zero_optimization.pipeline_loading_checkpoint (not yet implemented)" in message
    for quiet in ("prefetch_bucket_size", "reduce_bucket_size", "contiguous_gradients", "offload_optimizer",
                  "offload_param"):
        assert quiet not in message
    with _no_warnings():
        cfg.warn_unimplemented()


@pytest.mark.parametrize("cfg", [ZeroConfig(), ZeroConfig(stage=3, max_live_parameters=1e9),
                                 ZeroConfig(stage=2, contiguous_gradients=False, legacy_stage1=True),
                                 ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {
                                     "device": "none"}}})])
def test_warn_unimplemented_silent_without_unimplemented_settings(cfg):
    with _no_warnings():
        cfg.warn_unimplemented()
    assert cfg.unimplemented_fields() == ()


def test_explicit_fields_tracks_given_names():
    assert ZeroConfig().explicit_fields() == ()
    assert ZeroConfig(2, reduce_scatter=False).explicit_fields() == ("stage", "reduce_scatter")
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage3_max_live_parameters": 3}, "fp16": {}})
    assert cfg.explicit_fields() == ("max_live_parameters", "fp16")


# ----------------------------------------------------------------------------- jsonargparse


def _parser():
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(ZeroConfig, "zero")
    return parser


def test_jsonargparse_flags():
    parser = _parser()
    args = parser.parse_args(["--zero.stage", "2", "--zero.reduce_bucket_size", "1000",
                              "--zero.fp16.enabled", "true", "--zero.offload_optimizer.device", "cpu"])
    cfg = parser.instantiate(args).zero
    assert cfg == ZeroConfig(stage=2, reduce_bucket_size=1000, fp16={"enabled": True},
                             offload_optimizer={"device": "cpu"})


def test_jsonargparse_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("zero:\n  stage: 3\n  overlap_comm: false\n  offload_param:\n    device: cpu\n"
                    "  bf16:\n    enabled: true\n  gradient_clipping: 1.0\n")
    parser = _parser()
    cfg = parser.instantiate(parser.parse_args(["--config", str(path)])).zero
    assert cfg == ZeroConfig(stage=3, overlap_comm=False, offload_param={"device": "cpu"},
                             bf16={"enabled": True}, gradient_clipping=1.0)


def test_jsonargparse_instantiate_validates():
    parser = _parser()
    with pytest.raises(ZeroConfigError, match=re.escape("zero_optimization.offload_param needs stage 3")):
        parser.instantiate(parser.parse_args(["--zero.stage", "1", "--zero.offload_param.device", "cpu"]))


def test_jsonargparse_help_shows_field_docs():
    def squash(text):  # help wraps lines anywhere; a block's doc becomes its group title, ending in ':'
        return re.sub(r"\s+", "", text).rstrip(".")

    text = squash(_parser().format_help())
    for cls, prefix in [(ZeroConfig, "--zero."), (FP16Config, "--zero.fp16."), (BF16Config, "--zero.bf16.")]:
        for f in dataclasses.fields(cls):
            assert squash(prefix + f.name) in text
            assert squash(f.metadata["doc"]) in text, f.name


# ----------------------------------------------------------------------------- docs


def test_docs_name_every_field():
    text = DOCS.read_text()
    for path in field_paths():
        assert f"`{path}`" in text, path
    for alias in ALIASES:
        assert f"`{alias}`" in text, alias


def test_docs_tables_are_current():
    text = DOCS.read_text()
    begin, end = "<!-- BEGIN GENERATED: python -m zero_core.config -->\n", "<!-- END GENERATED -->"
    generated = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert generated == markdown_tables().strip(), "docs/config.md is stale: rerun python -m zero_core.config"


def test_class_docstrings_document_every_field():
    for cls in (ZeroConfig, OffloadParamConfig, OffloadOptimizerConfig, FP16Config, BF16Config):
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"] and f"    {f.name}: " in cls.__doc__


# ----------------------------------------------------------------------------- invalid input
# Each case: a builder taking tmp_path, and a piece of the expected message (matched literally).


def D(d):  # noqa: N802 -- short builders keep the case table readable
    return lambda tmp: ZeroConfig.from_dict(d)


def K(**kwargs):  # noqa: N802
    return lambda tmp: ZeroConfig(**kwargs)


def F(name, text):  # noqa: N802
    def build(tmp):
        path = tmp / name
        path.write_text(text)
        return ZeroConfig.from_file(path)
    return build


def _mutated_stage(tmp):
    cfg = ZeroConfig()
    cfg.stage = 9
    cfg.validate()


ZO = "zero_optimization"

INVALID = [
    # unknown keys at every level, with the suggestion
    ("zero-typo", D({"reduce_bucket_sise": 1}),
     "unknown key 'zero_optimization.reduce_bucket_sise'; did you mean 'reduce_bucket_size'?"),
    ("whole-zero-typo", D({ZO: {"overlap_com": True}}),
     "unknown key 'zero_optimization.overlap_com'; did you mean 'overlap_comm'?"),
    ("kwargs-typo", K(allgather_bucket_sizes=1),
     "unknown key 'zero_optimization.allgather_bucket_sizes'; did you mean 'allgather_bucket_size'?"),
    ("flat-run-typo", K(gradient_clip=1.0), "unknown key 'gradient_clip'; did you mean 'gradient_clipping'?"),
    ("no-close-match", D({"zzz": 1}), "unknown key 'zero_optimization.zzz'; docs/config.md lists the valid keys"),
    ("top-typo", D({ZO: {}, "gradient_cliping": 1.0}),
     "unknown key 'gradient_cliping'; did you mean 'gradient_clipping'?"),
    ("top-typo-deepspeed-key", D({ZO: {}, "train_batch_sise": 8}),
     "unknown key 'train_batch_sise'; did you mean 'train_batch_size'?"),
    ("offload-param-typo", D({"stage": 3, "offload_param": {"devise": "cpu"}}),
     "unknown key 'zero_optimization.offload_param.devise'; did you mean 'device'?"),
    ("offload-optimizer-typo", D({"stage": 1, "offload_optimizer": {"pin_memroy": True}}),
     "unknown key 'zero_optimization.offload_optimizer.pin_memroy'; did you mean 'pin_memory'?"),
    ("offload-no-match", D({"offload_optimizer": {"zzz": 1}}),
     "unknown key 'zero_optimization.offload_optimizer.zzz'; valid keys: buffer_count, delayed_update_after, "
     "device"),
    ("fp16-typo", D({ZO: {}, "fp16": {"loss_scale_windw": 10}}),
     "unknown key 'fp16.loss_scale_windw'; did you mean 'loss_scale_window'?"),
    ("bf16-typo", D({"bf16": {"enable": True}}), "unknown key 'bf16.enable'; did you mean 'enabled'?"),
    ("typo-set-to-auto", D({"fp16": {"enabeld": "auto"}}), "unknown key 'fp16.enabeld'; did you mean 'enabled'?"),
    ("zero-key-at-top", D({ZO: {}, "stage": 2}),
     "unknown top-level key 'stage': it belongs inside 'zero_optimization'"),
    ("run-key-in-zero", D({ZO: {"gradient_clipping": 1.0}}),
     "'zero_optimization.gradient_clipping' belongs at the top level of the DeepSpeed config"),
    # ranges
    ("stage-4", K(stage=4), "zero_optimization.stage must be one of 0, 1, 2, 3, got 4"),
    ("stage-negative", D({ZO: {"stage": -1}}), "zero_optimization.stage must be one of 0, 1, 2, 3, got -1"),
    ("reduce-bucket", K(reduce_bucket_size=-1), "zero_optimization.reduce_bucket_size must be >= 0, got -1"),
    ("allgather-bucket", K(allgather_bucket_size=-5), "zero_optimization.allgather_bucket_size must be >= 0, got -5"),
    ("shard-alignment", K(shard_alignment=0), "zero_optimization.shard_alignment must be >= 1, got 0"),
    ("sub-group", K(sub_group_size=-1), "zero_optimization.sub_group_size must be >= 0, got -1"),
    ("prefetch-alias", D({"stage3_prefetch_bucket_size": -1}),
     "zero_optimization.prefetch_bucket_size must be >= 0, got -1"),
    ("param-persistence", K(param_persistence_threshold=-1),
     "zero_optimization.param_persistence_threshold must be >= 0, got -1"),
    ("model-persistence", K(model_persistence_threshold=-1),
     "zero_optimization.model_persistence_threshold must be >= 0, got -1"),
    ("max-live", K(max_live_parameters=-1), "zero_optimization.max_live_parameters must be >= 0, got -1"),
    ("max-reuse", K(max_reuse_distance=-1), "zero_optimization.max_reuse_distance must be >= 0, got -1"),
    ("hpz", K(zero_hpz_partition_size=0), "zero_optimization.zero_hpz_partition_size must be >= 1, got 0"),
    ("mics-0", K(mics_shard_size=0), "zero_optimization.mics_shard_size must be -1 or >= 1, got 0"),
    ("mics-minus-2", K(mics_shard_size=-2), "zero_optimization.mics_shard_size must be -1 or >= 1, got -2"),
    ("param-buffer-count", K(stage=3, offload_param={"device": "cpu", "buffer_count": -1}),
     "zero_optimization.offload_param.buffer_count must be >= 0, got -1"),
    ("param-buffer-size", K(stage=3, offload_param={"buffer_size": -1}),
     "zero_optimization.offload_param.buffer_size must be >= 0, got -1"),
    ("param-max-in-cpu", K(offload_param={"max_in_cpu": -1}),
     "zero_optimization.offload_param.max_in_cpu must be >= 0, got -1"),
    ("optimizer-buffer-count", K(offload_optimizer={"buffer_count": -1}),
     "zero_optimization.offload_optimizer.buffer_count must be >= 0, got -1"),
    ("loss-scale", D({"fp16": {"loss_scale": -1}}), "fp16.loss_scale must be >= 0, got -1.0"),
    ("initial-scale-power", D({"fp16": {"initial_scale_power": -1}}), "fp16.initial_scale_power must be >= 0, got -1"),
    ("loss-scale-window", D({ZO: {}, "fp16": {"loss_scale_window": 0}}), "fp16.loss_scale_window must be >= 1, got 0"),
    ("hysteresis", K(fp16={"hysteresis": 0}), "fp16.hysteresis must be >= 1, got 0"),
    ("min-loss-scale", K(fp16={"enabled": True, "min_loss_scale": 0}),
     "fp16.min_loss_scale must be > 0, got 0.0"),
    ("direct-fp16", lambda tmp: FP16Config(min_loss_scale=-1), "fp16.min_loss_scale must be > 0, got -1.0"),
    ("clipping", D({ZO: {}, "gradient_clipping": -1.0}), "gradient_clipping must be >= 0, got -1.0"),
    ("clipping-nan", K(gradient_clipping=float("nan")), "gradient_clipping must be >= 0, got nan"),
    ("accumulation", K(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1, got 0"),
    # types
    ("bool-yes", D({"overlap_comm": "yes"}),
     "zero_optimization.overlap_comm must be true, false or null, got 'yes' (str)"),
    ("bool-int", K(contiguous_gradients=1),
     "zero_optimization.contiguous_gradients must be true or false, got 1 (int)"),
    ("int-fraction", K(reduce_bucket_size=1.5),
     "zero_optimization.reduce_bucket_size must be an integer, got 1.5 (float)"),
    ("int-string", D({"reduce_bucket_size": "5e8"}),
     "zero_optimization.reduce_bucket_size must be an integer, got '5e8' (str); write the number without quotes"),
    ("int-bool", K(stage=True), "zero_optimization.stage must be an integer, got True (bool)"),
    ("int-inf", K(sub_group_size=float("inf")), "zero_optimization.sub_group_size must be an integer, got inf"),
    ("float-string", D({ZO: {}, "gradient_clipping": "1.0"}), "gradient_clipping must be a number, got '1.0' (str)"),
    ("fp16-enabled-string", D({"fp16": {"enabled": "true"}}), "fp16.enabled must be true or false, got 'true' (str)"),
    ("auto-outside-zeroconfig", lambda tmp: BF16Config(enabled="auto"),
     "bf16.enabled must be true or false, got 'auto' (str); 'auto' is only understood by ZeroConfig itself"),
    ("nvme-path-type", K(stage=3, offload_param={"device": "nvme", "nvme_path": 5}),
     "zero_optimization.offload_param.nvme_path must be a string or null, got 5 (int)"),
    ("offload-not-mapping", K(stage=3, offload_param="cpu"),
     "zero_optimization.offload_param must be a mapping (or OffloadParamConfig) or null, got 'cpu' (str)"),
    ("fp16-none", K(fp16=None), "fp16 must be a mapping (or FP16Config), got None (NoneType)"),
    ("zero-not-mapping", D({ZO: [1, 2]}), "zero_optimization must be a mapping of ZeRO settings, got [1, 2]"),
    ("cpu-offload-type", D({"cpu_offload": "yes"}), "zero_optimization.cpu_offload must be true or false, got 'yes'"),
    # offload devices and combinations
    ("bad-device", K(stage=2, offload_optimizer={"device": "gpu"}),
     "zero_optimization.offload_optimizer.device must be one of 'none', 'cpu', 'nvme', got 'gpu'"),
    ("param-nvme-no-path", K(stage=3, offload_param={"device": "nvme"}),
     "zero_optimization.offload_param.nvme_path is required when device is 'nvme'"),
    ("optimizer-nvme-no-path", D({"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": ""}}),
     "zero_optimization.offload_optimizer.nvme_path is required when device is 'nvme'"),
    ("offload-param-stage-2", D({ZO: {"stage": 2, "offload_param": {"device": "cpu"}}}),
     "zero_optimization.offload_param needs stage 3, got stage 2; set zero_optimization.stage to 3"),
    ("offload-optimizer-stage-0", K(offload_optimizer={"device": "cpu"}),
     "zero_optimization.offload_optimizer needs stage 1, 2 or 3, got stage 0"),
    ("fp16-and-bf16", D({ZO: {}, "fp16": {"enabled": True}, "bf16": {"enabled": True}}),
     "fp16.enabled and bf16.enabled are both true; enable at most one"),
    ("fp16-and-bfloat16", D({ZO: {}, "fp16": {"enabled": True}, "bfloat16": {"enabled": True}}),
     "fp16.enabled and bf16.enabled are both true"),
    # the same field under two names
    ("alias-and-name", D({"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}),
     "zero_optimization.stage3_prefetch_bucket_size and zero_optimization.prefetch_bucket_size name the same field"),
    ("bf16-twice", D({ZO: {}, "bf16": {}, "bfloat16": {}}), "bfloat16 and bf16 name the same field; keep only 'bf16'"),
    ("deprecated-and-new", D({"stage": 1, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}),
     "zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both set"),
    # shapes and files
    ("not-a-mapping", D([("stage", 1)]), "a ZeRO config must be a mapping, got list"),
    ("non-string-key", D({1: 2}), "keys of the config must be strings, got 1 (int)"),
    ("non-string-zero-key", D({ZO: {1: 2}}), "keys of zero_optimization must be strings, got 1 (int)"),
    ("missing-file", lambda tmp: ZeroConfig.from_file(tmp / "missing.json"), "missing.json' does not exist"),
    ("bad-json", F("bad.json", '{"stage": 1,}'), "bad.json' is not valid JSON: Expecting property name"),
    ("bad-yaml", F("bad.yaml", "stage: [1\n"), "bad.yaml' is not valid YAML"),
    ("yaml-list", F("list.yml", "- 1\n- 2\n"), "list.yml' must hold a mapping at the top level, got list"),
    ("empty-yaml", F("empty.yaml", ""), "empty.yaml' must hold a mapping at the top level, got NoneType"),
    ("bad-suffix", F("zero.txt", "{}"), "zero.txt' has suffix '.txt'; use one of .json, .yaml, .yml"),
    ("duplicate-json-key", F("dup.json", '{"stage": 1, "stage": 2}'), "dup.json' is not valid: duplicate key 'stage'"),
    ("error-inside-file", F("ds.json", '{"zero_optimization": {"stage": 7}}'),
     "ds.json': zero_optimization.stage must be one of 0, 1, 2, 3, got 7"),
    # later checks
    ("validate-after-assignment", _mutated_stage, "zero_optimization.stage must be one of 0, 1, 2, 3, got 9"),
    ("resolve-unknown-path", lambda tmp: ZeroConfig().resolve_auto(reduce_bucket_sise=1),
     "resolve_auto: unknown key 'reduce_bucket_sise'; did you mean 'reduce_bucket_size'?"),
    ("resolve-bad-value", lambda tmp: ZeroConfig(reduce_bucket_size="auto").resolve_auto(reduce_bucket_size=-1),
     "zero_optimization.reduce_bucket_size must be >= 0, got -1"),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("build", "message"), [pytest.param(b, m, id=i) for i, b, m in INVALID])
def test_invalid_input(build, message, tmp_path):
    with pytest.raises(ZeroConfigError, match=re.escape(message)):
        build(tmp_path)


def test_invalid_cases_are_many_and_distinct():
    assert len(INVALID) >= 35
    assert len({case_id for case_id, _, _ in INVALID}) == len(INVALID)


def test_deepspeed_checkpoint_block_is_read():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3},
                                "checkpoint": {"use_node_local_storage": True, "tag_validation": "Fail"}})
    assert cfg.checkpoint.use_node_local_storage and cfg.checkpoint.tag_validation == "Fail"
    assert cfg.to_dict()["checkpoint"]["use_node_local_storage"] is True
    with pytest.raises(ZeroConfigError, match="checkpoint.tag_validation"):
        ZeroConfig.from_dict({"zero_optimization": {}, "checkpoint": {"tag_validation": "Loud"}})
    with pytest.raises(ZeroConfigError, match="did you mean 'use_node_local_storage'"):
        ZeroConfig.from_dict({"zero_optimization": {}, "checkpoint": {"use_node_local": True}})


def test_config_package_imports_no_other_core_module():
    """The config sits below every runtime: its files import each other, and zero_core.describe (torch, nothing of
    the core) for one error message, nothing else of zero_core."""
    allowed = ("zero_core.config", "zero_core.describe")
    found = []
    for path in sorted(pathlib.Path(zero_core.config.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.name}: {m}" for m in modules
                      if m.split(".")[0] == "zero_core" and not m.startswith(allowed)]
    assert not found, "zero_core/config/ imports other core modules:\n" + "\n".join(found)
