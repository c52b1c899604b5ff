"""Crash safety: a rank SIGKILLed in the middle of a save never leaves a loadable partial checkpoint, and the
earlier checkpoint at the same path stays intact and loads.

Two saves are killed, each in its own spawn (the harness stops every rank once one dies): rank 1 while it
writes its shard file (half the file is on disk), then rank 0 after the manifest is written but before the
directory is renamed into place; before that, the second spawn loads what the first one left.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from checkpoint_runs import ZeroRun, identical

CONFIG = {"stage": 2, "reduce_bucket_size": 150, "allgather_bucket_size": 150}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(victim: bool, where: str) -> None:
    """Make this rank kill itself at ``where`` during the next save (patched in this process only)."""
    from zero_core.checkpoint import save as save_module

    if not victim:
        return
    if where == "shard":
        real = save_module.write_safetensors

        def write_half_then_die(path, entries, metadata=None):
            real(path, entries, metadata)
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
            _die()

        save_module.write_safetensors = write_half_then_die
    else:
        save_module.publish = lambda temp, path: _die()


def _check_earlier(run, directory: Path) -> None:
    """Load the earlier checkpoint into a fresh engine (other seed, other stage); record what came back."""
    from zero_core.checkpoint import load_checkpoint

    fresh = ZeroRun("mlp", {"stage": 1}, seed=1)
    client_state = load_checkpoint(fresh.engine, directory / "ckpt")
    expected = torch.load(directory / "expected.pt", weights_only=True)
    if dist.get_rank() == 0:
        torch.save({"identical": identical(fresh.params(), expected), "step": client_state["step"]},
                   directory / "loaded.pt")


def killed_save_worker(rank: int, world_size: int, directory: str, victim: int, where: str) -> str:
    from zero_core.checkpoint import save_checkpoint

    directory = Path(directory)
    run = ZeroRun("mlp", CONFIG)
    run.train(2)
    if where == "shard":  # the first spawn writes the good checkpoint
        save_checkpoint(run.engine, directory / "ckpt", run.client_state())
        if rank == 0:
            torch.save(run.params(), directory / "expected.pt")
    else:  # the second spawn first loads what the first left
        _check_earlier(run, directory)
    run.train(1)
    _arm(rank == victim, where)
    save_checkpoint(run.engine, directory / "ckpt", run.client_state())
    return "not killed"


def _refusals(directory: Path) -> dict:
    from zero_core.checkpoint import read_manifest

    refusals = {}
    for temp in sorted(directory.glob(".ckpt.tmp-*")):
        try:
            read_manifest(temp)
            refusals[temp.name] = None
        except Exception as error:
            refusals[temp.name] = f"{type(error).__name__}: {error}"
    return refusals


@pytest.mark.timeout(300)
def test_killed_save_keeps_the_earlier_checkpoint(tmp_path):
    manifest = tmp_path / "ckpt" / "manifest.json"
    with pytest.raises(RuntimeError, match="exited with code -9|rank \\d raised"):
        run_distributed(killed_save_worker, 2, str(tmp_path), 1, "shard", timeout=120)
    earlier, refusals = manifest.read_text(), _refusals(tmp_path)
    with pytest.raises(RuntimeError, match="exited with code -9|rank \\d raised"):
        run_distributed(killed_save_worker, 2, str(tmp_path), 0, "publish", timeout=120)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded == {"identical": True, "step": 2}, f"the earlier checkpoint did not load intact: {loaded}"
    assert manifest.read_text() == earlier, "the killed saves replaced the earlier checkpoint"
    complete_but_unpublished = [t for t in tmp_path.glob(".ckpt.tmp-*") if (t / "manifest.json").exists()]
    assert complete_but_unpublished, "the save killed before publishing left no temporary directory to test"
    refusals.update(_refusals(tmp_path))
    for name, refusal in refusals.items():
        assert refusal is not None and "save that did not finish" in refusal, f"{name} was readable: {refusal}"
