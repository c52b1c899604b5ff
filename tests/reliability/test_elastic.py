"""Elastic size: two torchrun agents on localhost as two nodes (``--nnodes 1:2``, c10d rendezvous, one rank
each). The second node is killed (agent and worker, SIGKILL) after 8 steps: the first continues alone from
the latest checkpoint with twice the gradient accumulation; when the second node comes back the job grows to
two ranks again, and the final weights equal a fixed-size run's (computed here: the same global batches).

The agents' machinery is tests/support/elastic_agents.py (shared with tests/lightning/test_lightning_elastic.py).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

import zero_core
from elastic_agents import kill_node, start_agent, start_two_nodes, starts, wait_for
from launch import CORE_SCRIPTS, free_port

SCRIPT = CORE_SCRIPTS / "elastic.py"
sys.path.insert(0, str(SCRIPT.parent))
import elastic  # noqa: E402  (the script's model and samples, for the reference)


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
        args = (str(tmp_path / "checkpoints"), str(tmp_path / "out"))
        agents.extend(start_two_nodes(tmp_path, port, deadline, SCRIPT, *args))
        saved = lambda: len(list((tmp_path / "checkpoints").glob("step-*")))  # noqa: E731
        wait_for(lambda: saved() >= 4, deadline, "8 steps on two nodes", tmp_path)
        kill_node(agents[1])
        wait_for(lambda: len(starts(tmp_path / "out.jsonl")) >= 2, deadline, "a restart on the remaining node",
                 tmp_path)
        agents.append(start_agent(tmp_path, port, "node1-back", SCRIPT, *args))
        wait_for(lambda: agents[0].poll() is not None, deadline, "the job to finish", tmp_path)
        assert agents[0].returncode == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
    seen = starts(tmp_path / "out.jsonl")
    assert [(s["world"], s["accumulation"]) for s in seen] == [(2, 2), (1, 4), (2, 2)], seen
    assert 8 <= seen[1]["resumed_at"] < seen[2]["resumed_at"], seen
    got = torch.load(tmp_path / "out.pt")
    for name, value in fixed_size_weights().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def test_accumulation_for_keeps_the_global_batch_or_says_why_not():
    assert [zero_core.accumulation_for(8, 2, w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ValueError, match=r"global batch of 8 samples cannot be kept on 3 ranks"):
        zero_core.accumulation_for(8, 2, 3)
