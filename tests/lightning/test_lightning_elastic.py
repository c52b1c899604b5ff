"""Lightning keeps the global batch when a fit resumes at a smaller world size (a torchrun ``--nnodes MIN:MAX``
restart after a lost node): 4 steps on 2 ranks with accumulate_grad_batches=1 save a checkpoint; the same script
resumed on 1 rank runs with accumulation 2 and ends, after 8 steps, with the weights of a fixed-size run on the
same global batches (computed here). Then the whole story under two torchrun agents as two nodes: one node is
killed mid-run and the other finishes the fit alone, from the newest checkpoint, with those weights. The
re-planning's arithmetic and its one-line refusal are tested beside them."""

from __future__ import annotations

import time

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from elastic_agents import kill_node, start_two_nodes, starts, wait_for
from launch import LIGHTNING_SCRIPTS, free_port
from lightning_runs import run
from lightning_zero.elastic import KEY, keep_global_batch, replanned_accumulation
from restarts import assert_weights_equal, uninterrupted_weights

NODES_STEPS = 10


@pytest.mark.timeout(200)
def test_resume_on_fewer_ranks_keeps_the_global_batch_and_the_weights(tmp_path):
    run("elastic_resume.py", str(tmp_path), "2", "4", timeout=90)
    first = torch.load(tmp_path / "result-2.pt")
    assert (first["resumed_at"], first["accumulation"], first["global_step"]) == (0, 1, 4), first
    run("elastic_resume.py", str(tmp_path), "1", "8", timeout=90)
    second = torch.load(tmp_path / "result-1.pt")
    assert (second["resumed_at"], second["accumulation"], second["global_step"]) == (4, 2, 8), second
    assert_weights_equal(second["weights"], uninterrupted_weights(8, world_size=2))


@pytest.mark.timeout(150)
def test_a_lost_node_continues_on_the_other_from_the_newest_checkpoint_keeping_the_global_batch(tmp_path):
    """tests/lightning/scripts/elastic_nodes.py under ``torchrun --nnodes 1:2`` twice (one rank each, checkpoints
    every 2 steps). Once step 4's checkpoint appears the second node (agent and worker) is SIGKILLed; the first
    node's agent restarts the fit alone, which resumes from the newest verified checkpoint with accumulation 2."""
    port, deadline, agents = free_port(), time.monotonic() + 130, []
    script, args = LIGHTNING_SCRIPTS / "elastic_nodes.py", (str(tmp_path), str(NODES_STEPS), "0.4")
    try:
        agents.extend(start_two_nodes(tmp_path, port, deadline, script, *args))  # node0 hosts the rendezvous
        wait_for(lambda: any((tmp_path / "checkpoints").glob("*step=4*")), deadline, "4 steps on two nodes", tmp_path)
        kill_node(agents[1])
        wait_for(lambda: agents[0].poll() is not None, deadline, "the fit to finish on the other node", tmp_path)
        assert agents[0].returncode == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
    seen = starts(tmp_path / "starts.jsonl")
    assert [(s["attempt"], s["world"], s["accumulation"]) for s in seen] == [(0, 2, 1), (1, 1, 2)], seen
    # the newest complete checkpoint when the node died: step 4's, or step 2's if the kill cut step 4's save
    assert seen[1]["resumed_at"] in (2, 4, 6), seen
    assert_weights_equal(torch.load(tmp_path / "result.pt"), uninterrupted_weights(NODES_STEPS, world_size=2))


class _Trainer:
    accumulate_grad_batches = 1
    callbacks = ()


def test_replanning_keeps_world_times_accumulation_or_says_why_not():
    saved = {"world_size": 4, "accumulate_grad_batches": 2}
    assert [replanned_accumulation(saved, w, 1) for w in (1, 2, 4, 8)] == [8, 4, 1, 1]
    assert replanned_accumulation(saved, 4, 5) == 5  # the same size: the user's own choice stays
    with pytest.raises(ValueError, match=r"global batch of 8 micro-batches cannot be split over 3 ranks"):
        replanned_accumulation(saved, 3, 1)
    # The epoch's counters move to the same optimizer steps: 3 steps of 2 micro-batches -> 3 steps of 8.
    current = {"ready": 6, "started": 6, "processed": 6, "completed": 5}
    checkpoint = {KEY: saved, "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": current}}}}
    trainer = _Trainer()
    assert keep_global_batch(trainer, checkpoint, 1) == 8 == trainer.accumulate_grad_batches
    assert current == {"ready": 24, "started": 24, "processed": 24, "completed": 23}
    current.update(ready=7)
    with pytest.raises(ValueError, match="middle of an accumulation cycle"):
        keep_global_batch(_Trainer(), {KEY: {"world_size": 2, "accumulate_grad_batches": 2},
                                       "loops": checkpoint["loops"]}, 1)
    scheduled = _Trainer()
    scheduled.callbacks = [GradientAccumulationScheduler({0: 1})]
    with pytest.raises(ValueError, match="GradientAccumulationScheduler sets accumulate_grad_batches each epoch"):
        keep_global_batch(scheduled, {KEY: {"world_size": 2, "accumulate_grad_batches": 1}}, 1)
