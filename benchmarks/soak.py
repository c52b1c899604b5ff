"""Restart soak (not CI): ``python -m benchmarks.soak [--seed 0] [--steps 300]``.

A stage-3 job of 2 CPU ranks under ``torchrun --max-restarts 3`` trains STEPS steps, saving every 10 and keeping
the newest 3 checkpoints; three SIGKILLs at random steps (one per attempt, alternating ranks) kill it, and each
restart resumes from ``zero_core.latest_checkpoint``. Then the same job runs without kills. Checked and printed:
final weights against the uninterrupted run's, each attempt's resume point, that every checkpoint left verifies
(and how many there are), and the peak size of the checkpoint directory against one checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import zero_core

WORKER = Path(__file__).with_name("soak_worker.py")
REPO = WORKER.parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(root: Path, name: str, steps: int, save_every: int, keep: int, kills: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "3", "--monitor-interval", "0.5", "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), str(WORKER), str(root / f"{name}-checkpoints"), str(root / f"{name}.pt"),
               str(steps), str(save_every), str(keep), kills]
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=3)
    args = parser.parse_args()
    # Three kill steps, each past the previous (an attempt resumes at most save_every steps before it).
    kills = sorted(random.Random(args.seed).sample(range(5, args.steps - 5), 3))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        crashed_s = torchrun(root, "crashed", args.steps, args.save_every, args.keep, ",".join(map(str, kills)))
        reference_s = torchrun(root, "reference", args.steps, args.save_every, args.keep, "-")
        got, expected = torch.load(root / "crashed.pt"), torch.load(root / "reference.pt")
        diff = max((got["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
        attempts = [json.loads(line) for line in (root / "crashed.attempts.jsonl").read_text().splitlines()]
        directory = root / "crashed-checkpoints"
        left = sorted(p.name for p in directory.iterdir())
        problems = {p.name: zero_core.checkpoint_problem(p) for p in directory.iterdir()
                    if not p.name.startswith(".")}
        one = sum(f.stat().st_size for f in (directory / left[-1]).rglob("*") if f.is_file())
        print(f"kills after steps {kills} (ranks 0, 1, 0); attempts: {attempts}")
        print(f"final weights vs uninterrupted: max |diff| = {diff:.3g} (attempt {got['attempt']})")
        print(f"checkpoints left: {left}; damaged: {[k for k, v in problems.items() if v] or 'none'}")
        print(f"peak checkpoint directory: {got['peak_bytes']} bytes in the last attempt "
              f"(one checkpoint: {one} bytes, keep={args.keep})")
        print(f"wall time: crashed run {crashed_s:.0f} s, uninterrupted {reference_s:.0f} s")
        ok = diff <= 1e-6 and got["attempt"] == 3 and not any(problems.values()) and len(left) <= args.keep
        raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
