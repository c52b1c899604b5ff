"""Lightning test scripts (tests/lightning/scripts/) run as their own process session, and their outputs read back.

Lightning's launcher starts the other ranks as children of the script; they share its session, so a timeout
kills every rank, not only the first (``launch.finish``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch import LIGHTNING_SCRIPTS as SCRIPTS
from launch import REPO, child_env, finish, free_port, start as start_command

__all__ = ["REPO", "SCRIPTS", "finish", "free_port", "load_json", "load_rank", "max_diff", "run", "start"]


def start(script: str, *args: str, env: dict | None = None, cwd=None):
    """Start ``python SCRIPT ARGS`` (a name in tests/lightning/scripts/ or an absolute path)."""
    path = script if os.path.isabs(script) else str(SCRIPTS / script)
    return start_command([sys.executable, path, *args], env=child_env(**(env or {})), cwd=cwd or REPO)


def run(script: str, *args: str, timeout: float = 240, **kwargs) -> str:
    return finish(start(script, *args, **kwargs), timeout, f"{script} {' '.join(args)}")


def load_rank(out: Path, label: str, rank: int = 0) -> dict:
    import torch

    return torch.load(out / f"{label}.rank{rank}.pt", weights_only=True)


def load_json(out: Path, label: str):
    import json

    return json.loads((out / f"{label}.json").read_text())


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if not k.startswith("_"))
