"""Two torchrun agents on localhost as two nodes (``--nnodes 1:2``, c10d rendezvous, one rank each), for the
elastic tests: start an agent, SIGKILL a node (agent and workers), wait for a condition with the agents' logs
in the failure.

torch 2.13 needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` to grow: with the shared store, a joining agent waits
for the bootstrap address that the rank-0 agent writes only in its first round (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import child_env

RDZV_CONF = "last_call_timeout=5,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"


def start_agent(tmp: Path, port: int, name: str, script: Path, *args: str) -> subprocess.Popen:
    """One node: a torchrun agent with one worker running ``script args``, its output in ``tmp/<name>.log``."""
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf", RDZV_CONF,
               str(script), *args]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(command, env=env, cwd=str(tmp), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_two_nodes(tmp: Path, port: int, deadline: float, script: Path, *args: str) -> list[subprocess.Popen]:
    """node0, then node1 once node0 listens on the rendezvous port: both agents are on this host, so each would
    host torch's rendezvous store; the first to bind it does, and killing that node ends the job for all (seen:
    under load node1 bound it first, and the test's kill of node1 ended node0's agent with exit code 1)."""
    agents = [start_agent(tmp, port, "node0", script, *args)]
    try:
        wait_for(lambda: listening(port), deadline, "node0 to host the rendezvous store", tmp)
        agents.append(start_agent(tmp, port, "node1", script, *args))
    except BaseException:
        kill_node(agents[0])
        raise
    return agents


def listening(port: int) -> bool:
    """Whether a socket listens on ``port`` here, read from /proc/net/tcp* without connecting to it."""
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        rows = [line.split() for line in table.read_text().splitlines()[1:]] if table.exists() else []
        if any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows):  # 0A: LISTEN
            return True
    return False


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts them in sessions of their own)."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    pids = [int(p) for p in children.read_text().split()] if children.exists() else []
    for pid in [*pids, agent.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def wait_for(condition, deadline: float, what: str, tmp: Path) -> None:
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("*.log")))
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def starts(path: Path) -> list[dict]:
    """The JSON lines a job's rank 0 appends at each start (attempt, world size, accumulation, resumed step)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
