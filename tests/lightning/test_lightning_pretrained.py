"""``from_pretrained`` inside ``configure_model`` under ``zero3``: the model is built partitioned (each rank reads
its own slices of the weight files) and fine-tunes to DDP's weights (lightning/scripts/pretrained.py). Its
``save_pretrained`` on rank 0 alone is a clear error; saved inside ``GatheredParameters`` it writes the trained
weights."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from lightning_runs import load_json, load_rank, max_diff, run
from pretrained_files import save_tiny_llama

WEIGHT_TOLERANCE = 1e-5


@pytest.mark.timeout(300)
def test_from_pretrained_in_configure_model_builds_partitioned_and_trains_like_ddp(tmp_path):
    save_tiny_llama(tmp_path / "model", tied=False)
    run("pretrained.py", str(tmp_path / "model"), str(tmp_path), timeout=240)
    results = load_json(tmp_path, "pretrained")
    assert (results["ddp"], results["zero3"]) == ("Parameter", "PartitionedParameter")
    reference = load_rank(tmp_path, "pretrained_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(tmp_path, "pretrained_zero3", rank)) <= WEIGHT_TOLERANCE
    error = results["rank0_save_error"]
    assert error is not None and error.startswith("LlamaForCausalLM.save_pretrained without state_dict="), error
    assert "'model.embed_tokens.weight'" in error and "save_16bit_model" in error and "GatheredParameters" in error
    assert not (tmp_path / "rank0_alone").exists()  # refused before writing anything
    saved = {k: v for path in (tmp_path / "gathered").glob("*.safetensors") for k, v in load_file(path).items()}
    assert max_diff(load_rank(tmp_path, "pretrained_zero3"), saved) == 0
