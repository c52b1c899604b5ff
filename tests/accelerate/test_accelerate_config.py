"""accelerate_zero without launching: where ZeRO settings come from, how they combine with Accelerate's, the
zero.yaml reader, the starter file and the command line."""

import json
import os

import pytest
import torch
from torch import nn

from accelerate_zero import ZeroPlugin
from accelerate_zero.cli import _before_script, _from_script, _parse, main
from accelerate_zero.launch_config import launch_settings, read_launch_config, worker_environment
from accelerate_zero.resolve import accumulation_steps, hidden_size_autos, precision_flags, run_config
from zero_core import ZeroConfig, ZeroConfigError


# -- ZeroPlugin ----------------------------------------------------------------------------------------------
def test_plugin_defaults_to_stage_2_and_never_mutates_the_callers_config():
    assert ZeroPlugin().stage == 2
    given = ZeroConfig(stage=1)
    plugin = ZeroPlugin(config=given, stage=3)
    assert (plugin.stage, plugin.config.stage, given.stage) == (3, 3, 1)


def test_plugin_rejects_stage_0_naming_where_it_came_from(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(ZeroConfigError, match="stage is 0.*ACCELERATE_ZERO_CONFIG_FILE"):
        ZeroPlugin.from_env({"ACCELERATE_ZERO_CONFIG_FILE": str(path)})


def test_plugin_from_env_reads_inline_file_stage_and_autocast(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("zero_optimization: {stage: 3, stage3_param_persistence_threshold: 0}\n"
                    "torch_autocast: {enabled: true}\n")
    from_file = ZeroPlugin.from_env({"ACCELERATE_ZERO_CONFIG_FILE": str(path), "ACCELERATE_ZERO_STAGE": "2"})
    assert (from_file.stage, from_file.config.param_persistence_threshold, from_file.autocast) == (2, 0, True)
    inline = ZeroPlugin.from_env({"ACCELERATE_ZERO_CONFIG": '{"stage": 1, "reduce_scatter": false}',
                                  "ACCELERATE_ZERO_AUTOCAST": "false"})
    assert (inline.stage, inline.config.reduce_scatter, inline.autocast) == (1, False, False)


@pytest.mark.parametrize("env, words", [
    ({"ACCELERATE_ZERO_CONFIG": "{}", "ACCELERATE_ZERO_CONFIG_FILE": "x.json"}, "both"),
    ({"ACCELERATE_ZERO_CONFIG": "[1]"}, "JSON object"),
    ({"ACCELERATE_ZERO_CONFIG": "{stage: 2"}, "not valid JSON"),
    ({"ACCELERATE_ZERO_STAGE": "4"}, "must be 1, 2 or 3"),
    ({"ACCELERATE_ZERO_AUTOCAST": "maybe"}, "true or false"),
    ({"ACCELERATE_ZERO_CONFIG": '{"reduce_bucket_sise": 5}'}, "did you mean 'reduce_bucket_size'"),
])
def test_plugin_from_env_errors_name_the_variable_and_fix(env, words):
    with pytest.raises(ZeroConfigError, match=words):
        ZeroPlugin.from_env(env)


# -- combining with Accelerate's settings ------------------------------------------------------------------
@pytest.mark.parametrize("block, mixed_precision, expected", [
    ({"stage": 2}, "no", (False, False)),
    ({"stage": 2}, "bf16", (False, True)),
    ({"stage": 2}, "fp16", (True, False)),
    ({"stage": 2, "bf16": {"enabled": True}}, "no", (False, True)),  # the ZeRO config wins over "no"
    ({"stage": 2, "fp16": {"enabled": "auto"}}, "fp16", (True, False)),
    ({"stage": 2, "bf16": {"enabled": "auto"}}, "no", (False, False)),
])
def test_precision_follows_accelerate_as_its_deepspeed_plugin_does(block, mixed_precision, expected):
    flags = precision_flags(ZeroConfig.from_dict(block), mixed_precision)
    assert (flags["fp16.enabled"], flags["bf16.enabled"]) == expected


@pytest.mark.parametrize("block, mixed_precision, words", [
    ({"stage": 2, "fp16": {"enabled": True}}, "bf16", "sets fp16.enabled=true"),
    ({"stage": 2, "bf16": {"enabled": False}}, "bf16", "bf16.enabled=false"),
    ({"stage": 2}, "fp8", "not supported"),
])
def test_precision_contradictions_are_errors(block, mixed_precision, words):
    with pytest.raises(ValueError, match=words):
        precision_flags(ZeroConfig.from_dict(block), mixed_precision)


def test_accumulation_steps_come_from_one_place():
    cfg = ZeroConfig.from_dict({"stage": 2, "gradient_accumulation_steps": 4})
    assert accumulation_steps(cfg, 1) == 4 and accumulation_steps(cfg, 4) == 4
    assert accumulation_steps(ZeroConfig.from_dict({"stage": 2, "gradient_accumulation_steps": "auto"}), 3) == 3
    with pytest.raises(ZeroConfigError, match="in one place"):
        accumulation_steps(cfg, 2)


def test_run_config_fills_autos_like_accelerate_does_for_deepspeed():
    class Hf(nn.Linear):
        config = type("Config", (), {"hidden_size": 64})()

    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                      "stage3_prefetch_bucket_size": "auto"},
                                "fp16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto"})
    out = run_config(cfg, "fp16", 2, Hf(2, 2))
    assert (out.reduce_bucket_size, out.prefetch_bucket_size) == (64 * 64, int(0.9 * 64 * 64))
    assert out.fp16.enabled and out.gradient_accumulation_steps == 2 and out.gradient_clipping == 0.0
    assert hidden_size_autos(nn.Linear(2, 2)) == {}
    plain = run_config(ZeroConfig(stage=1), "fp16", 1)
    assert plain.fp16.enabled and plain.fp16.auto_cast and plain.param_dtype == torch.float16


# -- zero.yaml -----------------------------------------------------------------------------------------------
def write(tmp_path, text):
    path = tmp_path / "zero.yaml"
    path.write_text(text)
    return path


def test_launch_config_splits_validates_and_hands_the_block_over_as_written(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_ZERO_CONFIG_FILE", raising=False)
    path = write(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: 'no'\n"
                           "zero_optimization:\n  stage: 3\n  reduce_bucket_size: 5.0e+8\n  overlap_comm: auto\n")
    launch = read_launch_config(path)
    assert launch.zero == {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": "auto"}
    config, env = launch_settings(launch.accelerate)
    assert config["distributed_type"] == "MULTI_GPU"  # several local processes go through torchrun
    if not torch.cuda.is_available():
        assert env == {"ACCELERATE_USE_CPU": "true"} and config["use_cpu"] is True
    handed = worker_environment(launch)
    assert json.loads(handed["ACCELERATE_ZERO_CONFIG"]) == launch.zero
    assert ZeroPlugin.from_env(handed).stage == 3


@pytest.mark.parametrize("text, words", [
    ("distributed_type: MULTI_GPU\n", "no 'zero_optimization:' block"),
    ("zero_optimization: [1]\n", "list as 'zero_optimization:'"),
    ("zero_optimization: {stage: 2}\ngradient_clipping: 1.0\n", "move it inside the 'zero_optimization:'"),
    ("zero_optimization: {stage: 2}\nnum_proceses: 2\n", "unknown key 'num_proceses'"),
    ("zero_optimization: {stage: 2}\ndistributed_type: DEEPSPEED\n", "accelerate-zero runs ZeRO itself"),
    ("zero_optimization: {stage: 2, overlap_com: true}\n", "did you mean 'overlap_comm'"),
    ("zero_optimization: {stage: 0}\n", "stage is 0"),
    ("zero_optimization: {stage: 2}\nmixed_precision: fp8\n", "zero.yaml: mixed_precision must be"),
    ("zero_optimization: {stage: 2\n", "not valid YAML"),
])
def test_launch_config_errors_name_the_file_key_and_fix(tmp_path, text, words):
    with pytest.raises(Exception, match=words):
        read_launch_config(write(tmp_path, text))


def test_launch_config_reads_deepspeeds_torch_autocast_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_ZERO_CONFIG_FILE", raising=False)
    launch = read_launch_config(write(tmp_path, "mixed_precision: bf16\ntorch_autocast: {enabled: true}\n"
                                                "zero_optimization: {stage: 1}\n"))
    assert ZeroPlugin.from_env(worker_environment(launch)).autocast is True
    with pytest.raises(ZeroConfigError, match="only 'enabled: true'"):
        read_launch_config(write(tmp_path, "torch_autocast: {enabled: true, dtype: bfloat16}\n"
                                           "zero_optimization: {stage: 1}\n"))


def test_launch_config_refuses_a_second_source_of_zero_settings(tmp_path, monkeypatch):
    launch = read_launch_config(write(tmp_path, "zero_optimization: {stage: 2}\n"))
    monkeypatch.setenv("ACCELERATE_ZERO_CONFIG_FILE", "other.json")
    with pytest.raises(ZeroConfigError, match="unset the variable"):
        worker_environment(launch)


# -- the command line ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_config_command_writes_a_starter_that_launch_accepts(tmp_path, stage, capsys):
    out = tmp_path / f"zero{stage}.yaml"
    main(["config", "--output", str(out), "--stage", str(stage), "--mixed-precision", "bf16"])
    launch = read_launch_config(out)
    assert launch.zero["stage"] == stage and launch.accelerate["mixed_precision"] == "bf16"
    assert ("stage3_gather_16bit_weights_on_model_save" in launch.zero) == (stage == 3)
    with pytest.raises(SystemExit, match="--force"):
        main(["config", "--output", str(out)])


def test_launch_arguments_split_between_us_accelerate_and_the_script():
    args = _parse(["launch", "--config", "z.yaml", "--swap-accelerator", "--main_process_port", "0", "-m",
                   "train.py", "--config", "mine", "--lr", "1"])
    assert (args.config, args.swap_accelerator) == ("z.yaml", True)
    assert _before_script(args.rest) == ["--main_process_port", "0", "-m"]
    assert _from_script(args.rest) == ["train.py", "--config", "mine", "--lr", "1"]


def test_launch_hands_over_settings_and_runs_accelerates_launcher(tmp_path, monkeypatch):
    import accelerate.commands.launch as accelerate_launch

    seen = {}

    def fake_launch_command(args):
        seen.update(args=args, config=open(args.config_file).read(), env=dict(os.environ))

    monkeypatch.setattr(accelerate_launch, "launch_command", fake_launch_command)
    monkeypatch.delenv("ACCELERATE_ZERO_CONFIG_FILE", raising=False)
    for key in ("ACCELERATE_ZERO_CONFIG", "ACCELERATE_ZERO_AUTOCAST", "ACCELERATE_USE_CPU"):
        monkeypatch.setenv(key, "")  # restored after the test; the launcher overwrites them
    path = write(tmp_path, "num_processes: 2\nzero_optimization: {stage: 1}\n")
    main(["launch", "--config", str(path), "--swap-accelerator", "--main_process_port", "0", "train.py", "--lr", "1"])
    args = seen["args"]
    assert (args.module, args.training_script, args.training_script_args) == (True, "accelerate_zero.swap",
                                                                             ["train.py", "--lr", "1"])
    assert args.main_process_port == 0 and "distributed_type: MULTI_GPU" in seen["config"]
    assert json.loads(seen["env"]["ACCELERATE_ZERO_CONFIG"]) == {"stage": 1}


def test_launch_without_a_script_or_with_a_bad_config_exits_with_a_message(tmp_path):
    path = write(tmp_path, "zero_optimization: {stage: 2}\n")
    with pytest.raises(SystemExit, match="give the training script"):
        main(["launch", "--config", str(path)])
    with pytest.raises(SystemExit, match="no launch config"):
        main(["launch", "--config", str(tmp_path / "missing.yaml"), "train.py"])
