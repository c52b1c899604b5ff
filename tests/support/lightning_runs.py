"""Run a Lightning test script as its own process group, with a deadline, and report its output on failure.

Lightning's launcher starts the other ranks as children of the script; they share its process group, so a
timeout kills every rank, not only the first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parents[1]
# Set by a launcher around pytest itself; a script must start its own ranks.
_LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(script: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    clean.update(PYTHONUNBUFFERED="1", **(env or {}))
    path = script if os.path.isabs(script) else str(SCRIPTS / script)
    return subprocess.Popen([sys.executable, path, *args], env=clean, cwd=str(cwd or REPO), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float, label: str) -> str:
    """Wait for ``process``; on timeout or failure kill its whole group and raise with the output's tail."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{label} ran past {timeout:g} s; all its ranks were killed:\n{output[-6000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # a rank left behind by a crash
        except ProcessLookupError:
            pass
    if process.returncode != 0:
        raise AssertionError(f"{label} exited with {process.returncode}:\n{output[-6000:]}")
    return output


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
