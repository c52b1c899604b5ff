"""Damaged and mismatched checkpoints: each gives its own error, naming the file and the tensor, on every
rank (no rank hangs waiting for another that gave up). Strict and non-strict loading.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_distributed
from checkpoint_runs import ZeroRun

SHARD0, SHARD1 = "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"


def _data_start(path: Path) -> int:
    from zero_core.checkpoint.format import read_safetensors_header

    return read_safetensors_header(path)[0]


def _truncate(directory: Path) -> None:
    path = directory / SHARD1
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * 0.6))


def _flip_data_byte(directory: Path) -> None:
    path = directory / SHARD0
    with open(path, "r+b") as f:
        f.seek(_data_start(path) + 1001)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damage_header(directory: Path) -> None:
    with open(directory / SHARD1, "r+b") as f:
        f.seek(9)
        f.write(b"#")


def _append(directory: Path) -> None:
    with open(directory / SHARD0, "ab") as f:
        f.write(b"extra")


def _truncate_manifest(directory: Path) -> None:
    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text[: len(text) // 2])


# case -> (how to damage a copy of the good checkpoint, exception type, texts the message must contain)
DAMAGE = {
    "truncated": (_truncate, "CheckpointError", ["truncated", SHARD1, "tensor '"]),
    "corrupted": (_flip_data_byte, "CheckpointError", ["corrupted", SHARD0, "damaged: tensor '"]),
    "bad-header": (_damage_header, "CheckpointError", ["corrupted", SHARD1, "header"]),
    "grown": (_append, "CheckpointError", ["size mismatch", SHARD0]),
    "missing-shard": (lambda d: (d / SHARD1).unlink(), "CheckpointError", ["missing", SHARD1, "parameter '"]),
    "bad-manifest": (_truncate_manifest, "CheckpointError", ["manifest.json", "not valid JSON"]),
    "no-manifest": (lambda d: (d / "manifest.json").unlink(), "CheckpointError", ["not a complete checkpoint"]),
    "no-such-directory": (shutil.rmtree, "FileNotFoundError", ["no checkpoint directory", "no-such-directory"]),
}


class Pair(nn.Module):
    """Two linear layers whose names and sizes the mismatch cases vary."""

    def __init__(self, first: str = "a", second: str = "b", width: int = 4):
        super().__init__()
        torch.manual_seed(len(first + second) + width)
        self.add_module(first, nn.Linear(width, 3))
        self.add_module(second, nn.Linear(3, 2))


def _engine(module: nn.Module, optimizer_class=torch.optim.AdamW):
    import zero_core

    return zero_core.setup(module, optimizer_class(module.parameters(), lr=0.01), {"stage": 2})


def _step(engine) -> None:
    loss = engine.module.b(engine.module.a(torch.ones(2, 4))).sum()
    engine.backward(loss)
    engine.step()


def _outcome(fn) -> tuple:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        return None, [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    except Exception as error:
        return type(error).__name__, str(error)


def mismatch_cases(directory: Path) -> dict:
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    source = _engine(Pair())
    _step(source)
    save_checkpoint(source, directory / "pair")
    other = _engine(Pair(second="c"))
    before = other.module.c.weight.detach().clone()
    out = {
        "wider": _outcome(lambda: load_checkpoint(_engine(Pair(width=5)), directory / "pair")),
        "renamed": _outcome(lambda: load_checkpoint(other, directory / "pair")),
        "renamed-non-strict": _outcome(lambda: load_checkpoint(other, directory / "pair", strict=False)),
        "other-optimizer": _outcome(lambda: load_checkpoint(_engine(Pair(), torch.optim.SGD), directory / "pair")),
    }
    out["non-strict-loaded"] = (torch.equal(other.module.a.weight, source.module.a.weight)
                                and torch.equal(other.module.c.weight, before))
    return out


def errors_worker(rank: int, world_size: int, directory: str) -> dict:
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    directory = Path(directory)
    run = ZeroRun("transformer", {"stage": 2, "reduce_bucket_size": 300, "allgather_bucket_size": 300})
    run.train(1)
    save_checkpoint(run.engine, directory / "good", run.client_state())
    if rank == 0:
        for case, (damage, _, _) in DAMAGE.items():
            shutil.copytree(directory / "good", directory / case)
            damage(directory / case)
    dist.barrier()
    target = ZeroRun("transformer", {"stage": 2}, seed=1)
    results = {case: _outcome(lambda: load_checkpoint(target.engine, directory / case)) for case in DAMAGE}
    results["good"] = _outcome(lambda: load_checkpoint(target.engine, directory / "good"))
    results["mlp-from-transformer"] = _outcome(lambda: load_checkpoint(ZeroRun("mlp", {"stage": 2}).engine,
                                                                       directory / "good"))
    results.update(mismatch_cases(directory))
    return results


def _check(results: dict, rank: int) -> list[str]:
    problems = []
    for case, (_, expected_type, texts) in DAMAGE.items():
        kind, message = results[case]
        if kind != expected_type or not all(t in message for t in texts):
            problems.append(f"rank {rank} {case}: expected {expected_type} with {texts}, got {kind}: {message}")
    expected = {
        "good": (None, None),
        "mlp-from-transformer": ("CheckpointMismatchError", ["missing from the checkpoint", "'inp.weight'",
                                                             "unexpected", "'tok.weight'"]),
        "wider": ("CheckpointMismatchError", ["shape mismatch", "'a.weight': checkpoint (3, 4), model (3, 5)"]),
        "renamed": ("CheckpointMismatchError", ["missing from the checkpoint: ['c.bias', 'c.weight']",
                                                "unexpected in the checkpoint: ['b.bias', 'b.weight']", "strict=False"]),
        "renamed-non-strict": (None, ["non-strict checkpoint load", "'c.weight'"]),
        "other-optimizer": ("CheckpointMismatchError", ["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"]),
    }
    for case, (kind, texts) in expected.items():
        got_kind, message = results[case]
        text = " ".join(message) if isinstance(message, list) else (message or "")
        if got_kind != kind or not all(t in text for t in texts or []):
            problems.append(f"rank {rank} {case}: expected {kind} with {texts}, got {got_kind}: {message}")
    if not results["non-strict-loaded"]:
        problems.append(f"rank {rank}: non-strict load did not load 'a' and keep 'c'")
    return problems


@pytest.mark.timeout(240)
def test_damaged_and_mismatched_checkpoints_give_their_errors(tmp_path):
    per_rank = run_distributed(errors_worker, 2, str(tmp_path), timeout=180)
    problems = [p for rank, results in enumerate(per_rank) for p in _check(results, rank)]
    assert not problems, "\n".join(problems)
