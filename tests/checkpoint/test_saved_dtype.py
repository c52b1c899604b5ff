"""A saved Hugging Face model's ``config.json`` names the dtype of the weights written, on every save path.

``from_pretrained`` (default dtype) builds the model in the dtype its config names. Before, ``Trainer.save_model``
under the engine's bf16 wrote the fp32 masters beside a config saying bfloat16, so loading rounded the fine-tuned
weights silently. One launch (2 ranks, tests/accelerate/scripts/saved_dtype.py) saves through ``save_model``,
Accelerate's ``save_pretrained`` recipe and ``save_16bit_model`` at stages 2 and 3; here the step-2 checkpoint
is also consolidated offline (API and ``zero-checkpoint consolidate --hf_config``). Each directory then loads
with ``from_pretrained``: every tensor equals the one in the files, in the dtype the config names.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zero_core
from accelerate_runs import ACCELERATE_YAML, SCRIPTS, clean_env, run

STAGES = (2, 3)
SAVES = ("save_model", "save_pretrained", "save_16bit", "consolidated_bf16", "consolidated_fp32")
EXPECTED = {"save_model": torch.float32, "save_pretrained": torch.bfloat16, "save_16bit": torch.bfloat16,
            "consolidated_bf16": torch.bfloat16, "consolidated_fp32": torch.float32}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("saved_dtype")
    (tmp / "accelerate.yaml").write_text(ACCELERATE_YAML)
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", tmp / "accelerate.yaml",
         "-m", "accelerate_zero.swap", SCRIPTS / "saved_dtype.py", tmp], cwd=tmp,
        env=clean_env(ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1"), timeout=240)
    for stage in STAGES:
        checkpoint = tmp / f"z{stage}" / "checkpoint-2"
        zero_core.consolidate(checkpoint / "zero_model", tmp / f"z{stage}" / "consolidated_bf16", dtype="bf16",
                              hf_config=checkpoint, progress=False)
        run([sys.executable, "-m", "zero_core.checkpoint", "consolidate", checkpoint / "zero_model",
             tmp / f"z{stage}" / "consolidated_fp32", "--dtype", "fp32", "--hf_config", checkpoint / "config.json",
             "--progress", "false"], cwd=tmp, env=clean_env(), timeout=120)
    return tmp


def written(directory: Path) -> dict:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("stage", STAGES)
def test_from_pretrained_loads_the_weights_written_in_the_dtype_the_config_names(out, stage, save):
    from transformers import AutoModelForCausalLM

    directory = out / f"z{stage}" / save
    files = written(directory)
    named = json.loads((directory / "config.json").read_text())["dtype"]
    assert {str(t.dtype) for t in files.values() if t.is_floating_point()} == {f"torch.{named}"}
    assert getattr(torch, named) == EXPECTED[save]
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.dtype == EXPECTED[save]
    loaded = model.state_dict()
    for name, tensor in files.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("stage", STAGES)
def test_save_model_writes_the_fp32_masters_that_round_to_the_live_bf16_weights(out, stage):
    masters, live = written(out / f"z{stage}" / "save_model"), written(out / f"z{stage}" / "save_pretrained")
    assert sorted(masters) == sorted(live)
    assert all(torch.equal(masters[k].to(torch.bfloat16), live[k]) for k in masters)
    assert any(not torch.equal(masters[k], live[k].float()) for k in masters)  # more precise than bf16
