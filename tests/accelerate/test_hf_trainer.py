"""An unmodified Hugging Face ``Trainer`` script under ZeRO against plain ``accelerate launch`` (DDP).

tests/accelerate/scripts/hf_trainer.py trains a tiny GPT-2 (accumulation, clipping, warmup + linear schedule)
for 8 steps with a checkpoint at step 4, saves the model, then resumes a fresh Trainer from that checkpoint.
It runs three times, 2 CPU processes each: plain ``accelerate launch`` (DDP); stage 3 through the documented
recipe ``accelerate-zero launch --config zero.yaml --swap-accelerator``; stage 2 through ``accelerate launch
-m accelerate_zero.swap`` with the stage from the environment; stage 3 with the optimizer and the parameters on
NVMe (ZeRO-Infinity) and 500-element tiles, so that the embeddings' pieces are streamed in slices by the step and
by every checkpoint. The stage 3 launches also resume from the DDP launch's checkpoint (whole ``optimizer.pt`` and
``model.safetensors``). Each launch also runs a Trainer that
evaluates every 2 steps and loads the best checkpoint at the end (``load_best_model_at_end``).
"""

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from accelerate_runs import ACCELERATE_YAML, SCRIPTS, accelerate_launch, clean_env, run

TOLERANCE = 1e-5
SCRIPT = "hf_trainer.py"

ZERO3_YAML = ACCELERATE_YAML + """\
zero_optimization:
  stage: 3
  stage3_param_persistence_threshold: 0
"""


ZERO3_NVME_YAML = ZERO3_YAML + """\
  sub_group_size: 500
  offload_optimizer: {device: nvme, nvme_path: NVME}
  offload_param: {device: nvme, nvme_path: NVME, max_in_cpu: 0}
"""


def _read(out: Path) -> dict:
    result = json.loads((out / "result.json").read_text())
    runs = [name for name in ("full", "resumed", "from_other", "best") if (out / name / "final").is_dir()]
    result["weights"] = {name: load_file(out / name / "final" / "model.safetensors") for name in runs}
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_trainer")
    accelerate_launch(tmp, SCRIPT, tmp / "ddp", env=clean_env())
    (tmp / "zero.yaml").write_text(ZERO3_YAML)
    run([sys.executable, "-m", "accelerate_zero", "launch", "--config", tmp / "zero.yaml", "--swap-accelerator",
         SCRIPTS / SCRIPT, tmp / "zero3", tmp / "ddp" / "full" / "checkpoint-4"], cwd=tmp, env=clean_env(), timeout=300)
    (tmp / "nvme").mkdir()
    (tmp / "zero_nvme.yaml").write_text(ZERO3_NVME_YAML.replace("NVME", str(tmp / "nvme")))
    run([sys.executable, "-m", "accelerate_zero", "launch", "--config", tmp / "zero_nvme.yaml", "--swap-accelerator",
         SCRIPTS / SCRIPT, tmp / "zero3_nvme", tmp / "ddp" / "full" / "checkpoint-4"], cwd=tmp, env=clean_env(),
        timeout=300)
    config = tmp / "accelerate.yaml"  # written by accelerate_launch above
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m", "accelerate_zero.swap",
         SCRIPTS / SCRIPT, tmp / "zero2"], cwd=tmp,
        env=clean_env(ACCELERATE_USE_CPU="true", ACCELERATE_ZERO_STAGE="2"), timeout=300)
    runs = {name: _read(tmp / name) for name in ("ddp", "zero3", "zero2", "zero3_nvme")}
    runs["zero3_nvme"]["swap_files_left"] = sorted(p.name for p in (tmp / "nvme").iterdir())
    return runs


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOLERANCE for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_nvme"])
def test_trainer_logs_the_same_losses_norms_and_rates_as_ddp(runs, name):
    ddp, zero = runs["ddp"], runs[name]
    assert (ddp["accelerator"], zero["accelerator"], zero["world_size"]) == ("Accelerator", "ZeroAccelerator", 2)
    assert len(ddp["log"]["loss"]) == 8 and any(n > 0.5 for n in ddp["log"]["grad_norm"]), "clipping should act"
    for key in ("loss", "grad_norm", "learning_rate"):
        assert close(zero["log"][key], ddp["log"][key]), (key, zero["log"][key], ddp["log"][key])


@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_nvme"])
def test_save_model_writes_ddps_weights(runs, name):
    assert max_diff(runs[name]["weights"]["full"], runs["ddp"]["weights"]["full"]) <= TOLERANCE


@pytest.mark.parametrize("name", ["ddp", "zero3", "zero2", "zero3_nvme"])
def test_resume_from_a_trainer_checkpoint_ends_at_the_uninterrupted_weights(runs, name):
    result = runs[name]
    assert max_diff(result["weights"]["resumed"], result["weights"]["full"]) == 0.0
    for key in ("loss", "grad_norm", "learning_rate"):
        assert result["resumed_log"][key] == result["log"][key]


@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_nvme"])
def test_checkpoint_holds_the_engines_sharded_state_instead_of_rank_0s_shard(runs, name):
    files = set(runs[name]["checkpoint_files"])
    assert {"zero_model/manifest.json", "zero_model/shard-00000-of-00002.safetensors",
            "zero_model/shard-00001-of-00002.safetensors", "zero_state.json", "scheduler.pt",
            "model.safetensors", "trainer_state.json"} <= files
    assert "optimizer.pt" not in files and "optimizer.pt" in runs["ddp"]["checkpoint_files"]


@pytest.mark.parametrize("name", ["zero3", "zero3_nvme"])
def test_stage_3_resumes_from_a_checkpoint_written_under_ddp(runs, name):
    assert max_diff(runs[name]["weights"]["from_other"], runs["ddp"]["weights"]["full"]) <= TOLERANCE


def test_nvme_leaves_no_swap_files_behind(runs):
    assert runs["zero3_nvme"]["swap_files_left"] == []


@pytest.mark.parametrize("name", ["zero3", "zero2", "zero3_nvme"])
def test_load_best_model_at_end_loads_the_same_checkpoint_as_ddp(runs, name):
    ddp, zero = runs["ddp"], runs[name]
    assert close(zero["eval_losses"], ddp["eval_losses"]) and len(ddp["eval_losses"]) == 4
    assert zero["best_checkpoint"] == ddp["best_checkpoint"] != "checkpoint-8"
    assert max_diff(zero["weights"]["best"], ddp["weights"]["best"]) <= TOLERANCE
    assert max_diff(zero["weights"]["best"], zero["weights"]["full"]) > 1e-4  # an earlier checkpoint was loaded
