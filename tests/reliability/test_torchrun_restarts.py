"""Resume after a crash: under ``torchrun --max-restarts 1`` one rank is SIGKILLed mid-run; the restarted job
finds the newest complete checkpoint by itself (zero_core.latest_checkpoint) and ends with the weights of an
uninterrupted run. Also: latest_checkpoint skips an interrupted save's leftovers and a damaged checkpoint,
with a warning naming them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import zero_core
from distributed import run_distributed
from launch import CORE_SCRIPTS, free_port, run

SCRIPT = CORE_SCRIPTS / "crash_resume.py"
KILL_AT = 4  # after step 4 (0-based): checkpoints step-2 and step-4 exist, step-5 was done and is lost
TIMEOUT_S = 240


def torchrun(checkpoints: Path, out: Path, kill_at: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.5", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(SCRIPT), str(checkpoints), str(out), str(kill_at)]
    return run(command, timeout=TIMEOUT_S)


def test_killed_rank_restarts_and_resumes(tmp_path):
    torchrun(tmp_path / "crashed", tmp_path / "crashed.pt", KILL_AT)
    torchrun(tmp_path / "reference", tmp_path / "reference.pt", -1)
    got, expected = torch.load(tmp_path / "crashed.pt"), torch.load(tmp_path / "reference.pt")
    assert got["attempt"] == 1 and got["resumed_from"] == "step-4", (got["attempt"], got["resumed_from"])
    assert expected["attempt"] == 0 and expected["resumed_from"] is None
    for name, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-6, msg=name)


def _latest_worker(rank: int, world_size: int, root: str) -> list:
    root = Path(root)
    model = nn.Linear(5, 3)
    engine = zero_core.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 2})
    for name in ("a", "b", "c"):  # written in this order: c is the newest
        engine.save_checkpoint(root / name, {"name": name})
    return [str(p) for p in sorted(root.iterdir())]


def test_latest_checkpoint_skips_leftovers_and_damage(tmp_path):
    run_distributed(_latest_worker, 1, str(tmp_path), timeout=120)
    assert zero_core.latest_checkpoint(tmp_path) == tmp_path / "c"
    (tmp_path / ".d.tmp-0123456789abcdef").mkdir()  # an interrupted save of "d"
    shard = tmp_path / "c" / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte in c's last tensor
    shard.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert zero_core.latest_checkpoint(tmp_path) == tmp_path / "b"
    messages = " | ".join(str(w.message) for w in caught)
    assert ".d.tmp-0123456789abcdef" in messages and "'" + str(tmp_path / "c") + "'" in messages, messages
    assert zero_core.latest_checkpoint(tmp_path / "missing") is None
