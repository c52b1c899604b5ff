"""An unmodified fine-tuning script that calls ``from_pretrained`` before its ``Trainer``, under the swap at stage 3.

tests/accelerate/scripts/hf_pretrained.py loads a tiny Llama (tied embeddings, 4 safetensors shards, written by
``save_pretrained``), resizes its embeddings for added tokens and trains it 4 steps. Plain ``accelerate launch``
(DDP) is the reference; ``accelerate-zero launch --swap-accelerator`` at stage 3 must build the model already
partitioned (the role ``HfDeepSpeedConfig`` plays for DeepSpeed) and end with DDP's losses and weights.
"""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from accelerate_runs import ACCELERATE_YAML, SCRIPTS, accelerate_launch, clean_env, run
from pretrained_files import save_tiny_llama

TOLERANCE = 1e-5
SCRIPT = "hf_pretrained.py"
ZERO3_YAML = ACCELERATE_YAML + "use_cpu: true\nzero_optimization:\n  stage: 3\n  stage3_param_persistence_threshold: 0\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hf_pretrained")
    save_tiny_llama(tmp / "model")
    assert len(list((tmp / "model").glob("*.safetensors"))) > 1, "the weights should be sharded"
    accelerate_launch(tmp, SCRIPT, tmp / "model", tmp / "ddp", env=clean_env())
    (tmp / "zero.yaml").write_text(ZERO3_YAML)
    run([sys.executable, "-m", "accelerate_zero", "launch", "--config", tmp / "zero.yaml", "--swap-accelerator",
         SCRIPTS / SCRIPT, tmp / "model", tmp / "zero3"], cwd=tmp, env=clean_env(), timeout=300)
    return {name: {**json.loads((tmp / name / "result.json").read_text()),
                   "weights": load_file(tmp / name / "final" / "model.safetensors")} for name in ("ddp", "zero3")}


def test_from_pretrained_builds_the_model_partitioned_under_the_swap(runs):
    assert runs["ddp"]["accelerator"] == "Accelerator" and runs["ddp"]["loaded_as"] == "Parameter"
    assert runs["zero3"]["accelerator"] == "ZeroAccelerator"
    assert runs["zero3"]["loaded_as"] == "PartitionedParameter"


def test_fine_tuning_from_partitioned_weights_matches_ddp(runs):
    ddp, zero = runs["ddp"], runs["zero3"]
    assert len(ddp["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(zero["losses"], ddp["losses"])) <= TOLERANCE
    assert sorted(zero["weights"]) == sorted(ddp["weights"])
    assert zero["weights"]["model.embed_tokens.weight"].shape[0] == 100  # resized after the partitioned load
    assert max((zero["weights"][k] - ddp["weights"][k]).abs().max().item() for k in ddp["weights"]) <= TOLERANCE
