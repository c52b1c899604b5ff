"""A compiled LightningModule under ``Trainer(strategy="zero1/2/3")`` and a compiled model under Fabric at stages 1-3,
each against the same compiled run under DDP (lightning/scripts/compiled.py, one 2-process launch)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled")
    run("compiled.py", str(path), timeout=420)
    return path


@pytest.mark.timeout(450)
@pytest.mark.parametrize("run_name", ["trainer_zero1", "trainer_zero2", "trainer_zero3", "fabric_zero1", "fabric_zero2",
                                      "fabric_zero3"])
def test_compiled_module_matches_compiled_ddp(out, run_name):
    front_end = run_name.split("_")[0]
    reference = load_rank(out, f"{front_end}_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, run_name, rank)) <= WEIGHT_TOLERANCE
    graphs = load_json(out, "graphs")
    assert graphs[run_name] > 0 and graphs[f"{front_end}_ddp"] > 0  # both really ran compiled
