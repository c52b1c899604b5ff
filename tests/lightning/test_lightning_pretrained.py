"""``from_pretrained`` inside ``configure_model`` under ``zero3``: the model is built partitioned (each rank reads
its own slices of the weight files) and fine-tunes to DDP's weights (lightning/scripts/pretrained.py)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run
from pretrained_files import save_tiny_llama

WEIGHT_TOLERANCE = 1e-5


@pytest.mark.timeout(300)
def test_from_pretrained_in_configure_model_builds_partitioned_and_trains_like_ddp(tmp_path):
    save_tiny_llama(tmp_path / "model", tied=False)
    run("pretrained.py", str(tmp_path / "model"), str(tmp_path), timeout=240)
    assert load_json(tmp_path, "pretrained") == {"ddp": "Parameter", "zero3": "PartitionedParameter"}
    reference = load_rank(tmp_path, "pretrained_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(tmp_path, "pretrained_zero3", rank)) <= WEIGHT_TOLERANCE
