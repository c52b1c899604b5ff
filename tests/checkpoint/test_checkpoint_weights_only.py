"""``save_checkpoint(..., save_optimizer_states=False)`` (Lightning's ``weights_only``): the fp32 masters without
Adam's moments, about a third of the bytes; it loads the weights exactly and leaves the optimizer to start afresh.

Two ranks at stages 1 and 3, against a full checkpoint of the same engine in the same run."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from distributed import run_distributed


def _engine(seed: int, stage: int):
    import zero_core

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    config = {"stage": stage, "param_persistence_threshold": 0}
    return zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)


def _worker(rank: int, world_size: int, directory: str, stage: int) -> dict:
    from zero_core import GatheredParameters
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    engine = _engine(0, stage)
    for step in range(2):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine.module(x).square().mean())
        engine.step()
    weights_only, full = Path(directory) / "weights", Path(directory) / "full"
    save_checkpoint(engine, weights_only, save_optimizer_states=False)
    save_checkpoint(engine, full)

    resumed = _engine(1, stage)
    load_checkpoint(resumed, weights_only)  # load_optimizer_states=True: there is none, so none is loaded
    with GatheredParameters(list(engine.module.parameters()) + list(resumed.module.parameters())):
        equal = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), resumed.module.parameters()))
    masters = all(torch.equal(a.master_values(), b.master_values())
                  for a, b in zip(engine.fragments(), resumed.fragments()))
    state_after = sum(len(inner.state) for inner in resumed.inner_optimizers)
    return {"equal": equal, "masters": masters, "state_after": state_after,
            "manifest": json.loads((weights_only / "manifest.json").read_text()),
            "bytes": [sum(f.stat().st_size for f in p.glob("shard-*")) for p in (weights_only, full)]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_weights_only_checkpoint_holds_the_masters_alone_and_loads_them(stage, capsys):
    from zero_core.checkpoint.cli import main

    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_worker, 2, directory, stage, timeout=200)
        main(["inspect", str(Path(directory) / "weights")])
        said = capsys.readouterr().out
    for rank, result in enumerate(results):
        assert result["equal"] and result["masters"], (rank, result)
        assert result["state_after"] == 0, result  # the optimizer starts afresh
        optimizer = result["manifest"]["optimizer"]
        assert optimizer["classes"] == [] and optimizer["per_element_keys"] == [], optimizer
        assert optimizer["param_groups"][0]["hyperparameters"]  # the groups are still described
        weights, full = result["bytes"]
        assert weights * 5 < full * 2, result["bytes"]  # masters alone: a third of masters and two moments
    assert "optimizer: no state saved (weights only)" in said, said
