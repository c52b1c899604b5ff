"""Launching scripts and launchers (python, torchrun, accelerate launch) as subprocesses, for every test that does.

One launch: a free port when it needs one, the environment a launched job needs (this checkout and tests/support
on PYTHONPATH, one thread per rank, no launcher variables inherited from a launcher around pytest), its own
process session with a deadline (a timeout kills every rank the launcher started, not only the launcher), and a
failure that names the command and shows its output's tail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
CORE_SCRIPTS = TESTS / "core" / "scripts"
LIGHTNING_SCRIPTS = TESTS / "lightning" / "scripts"
ACCELERATE_SCRIPTS = TESTS / "accelerate" / "scripts"
# Set by a launcher around pytest itself; a launched job must start its own ranks.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "PL_GLOBAL_SEED")
OUTPUT_TAIL = 6000  # characters of a failed launch's output shown in the failure


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment for a launched job: without launcher variables, with this checkout and
    tests/support first on PYTHONPATH, one thread per rank, unbuffered output; ``extra`` set last."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(SUPPORT), env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def start(command: list, env: dict | None = None, cwd: Path | None = None,
          stderr_apart: bool = False) -> subprocess.Popen:
    """Start ``command`` in its own session (``env`` defaults to ``child_env()``); its errors go into its output
    unless ``stderr_apart`` (for a caller that parses the output)."""
    return subprocess.Popen([str(part) for part in command], env=child_env() if env is None else env,
                            cwd=str(cwd or REPO), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if stderr_apart else subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, timeout: float, label: str) -> str:
    """Wait for ``process``; on timeout or failure kill its whole session and raise with the output's tail.
    Returns its output (without its errors where ``start`` kept them apart)."""
    try:
        output, errors = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, errors = process.communicate()
        raise AssertionError(f"{label} ran past {timeout:g} s (a hang?); all its processes were killed:\n"
                             f"{(output + (errors or ''))[-OUTPUT_TAIL:]}") from None
    finally:
        stop(process)  # a rank left behind by a crash
    if process.returncode != 0:
        tail = (output + (errors or ""))[-OUTPUT_TAIL:]
        raise AssertionError(f"{label} exited with {process.returncode}:\n{tail}")
    return output


def stop(process: subprocess.Popen) -> None:
    """Kill every process left in ``process``'s session (``start`` gives each launch its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run(command: list, timeout: float = 240, env: dict | None = None, cwd: Path | None = None,
        stderr_apart: bool = False) -> str:
    """Run ``command`` to its end (see ``start`` and ``finish``); returns its output."""
    return finish(start(command, env=env, cwd=cwd, stderr_apart=stderr_apart), timeout, " ".join(map(str, command)))
