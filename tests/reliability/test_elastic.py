"""Elastic size: two torchrun agents on localhost as two nodes (``--nnodes 1:2``, c10d rendezvous, one rank
each). The second node is killed (agent and worker, SIGKILL) after 8 steps: the first continues alone from
the latest checkpoint with twice the gradient accumulation; when the second node comes back the job grows to
two ranks again, and the final weights equal a fixed-size run's (computed here: the same global batches).

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

import pytest
import torch

import zero_core
from launch import CORE_SCRIPTS, child_env, free_port

SCRIPT = CORE_SCRIPTS / "elastic.py"
sys.path.insert(0, str(SCRIPT.parent))
import elastic  # noqa: E402  (the script's model and samples, for the reference)


def start_agent(tmp: Path, port: int, name: str) -> subprocess.Popen:
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
               "--rdzv-conf", "last_call_timeout=5,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3",
               str(SCRIPT), str(tmp / "checkpoints"), str(tmp / "out")]
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen(command, env=env, cwd=str(tmp), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


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


def starts(tmp: Path) -> list[dict]:
    path = tmp / "out.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fixed_size_weights() -> dict:
    model = elastic.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(elastic.STEPS):
        x = torch.stack([elastic.sample(step, i) for i in range(elastic.GLOBAL)])
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.timeout(170)
def test_a_lost_node_continues_on_the_rest_and_grows_back(tmp_path):
    port, deadline, agents = free_port(), time.monotonic() + 150, []
    try:
        agents.append(start_agent(tmp_path, port, "node0"))
        time.sleep(0.5)  # node 0 hosts the rendezvous store
        agents.append(start_agent(tmp_path, port, "node1"))
        saved = lambda: len(list((tmp_path / "checkpoints").glob("step-*")))  # noqa: E731
        wait_for(lambda: saved() >= 4, deadline, "8 steps on two nodes", tmp_path)
        kill_node(agents[1])
        wait_for(lambda: len(starts(tmp_path)) >= 2, deadline, "a restart on the remaining node", tmp_path)
        agents.append(start_agent(tmp_path, port, "node1-back"))
        wait_for(lambda: agents[0].poll() is not None, deadline, "the job to finish", tmp_path)
        assert agents[0].returncode == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
    seen = starts(tmp_path)
    assert [(s["world"], s["accumulation"]) for s in seen] == [(2, 2), (1, 4), (2, 2)], seen
    assert 8 <= seen[1]["resumed_at"] < seen[2]["resumed_at"], seen
    got = torch.load(tmp_path / "out.pt")
    for name, value in fixed_size_weights().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def test_accumulation_for_keeps_the_global_batch_or_says_why_not():
    assert [zero_core.accumulation_for(8, 2, w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match=r"global batch of 8 samples cannot be kept on 3 ranks"):
        zero_core.accumulation_for(8, 2, 3)
