"""Accelerate keeps the global batch when ``load_state()`` resumes at a smaller world size (a torchrun
``--nnodes MIN:MAX`` restart after a lost node): 4 steps on 2 processes with gradient_accumulation_steps=1 save
their state; the same script resumed on 1 process runs with accumulation 2 and ends, after 8 steps, with the
weights of a fixed-size run on the same global batches. The re-planning's refusals are tested beside it."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.elastic import keep_global_batch
from launch import ACCELERATE_SCRIPTS, free_port
from restarts import assert_weights_equal, launch, torchrun, uninterrupted_weights

SCRIPT = ACCELERATE_SCRIPTS / "elastic_resume.py"


@pytest.mark.timeout(200)
def test_load_state_on_fewer_processes_keeps_the_global_batch_and_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "out"
    launch(torchrun(SCRIPT, str(out), "4", port=free_port(), restarts=0, nproc=2), timeout=90, cwd=tmp_path)
    assert (torch.load(out / "result-2.pt")["accumulation"]) == 1
    launch(torchrun(SCRIPT, str(out), "8", port=free_port(), restarts=0, nproc=1), timeout=90, cwd=tmp_path)
    second = torch.load(out / "result-1.pt")
    assert (second["resumed_at"], second["accumulation"]) == (4, 2), second
    assert_weights_equal(second["weights"], uninterrupted_weights(8, world_size=2))


class _Accelerator:
    num_processes, gradient_accumulation_steps, step, is_main_process = 1, 1, 0, True


def test_replanning_moves_the_step_count_or_says_why_not():
    accelerator = _Accelerator()
    accelerator.step = 4  # two optimizer steps of 2 micro-batches since the last sync point
    assert keep_global_batch(accelerator, {"world_size": 4, "gradient_accumulation_steps": 2}) == 8
    assert (accelerator.gradient_accumulation_steps, accelerator.step) == (8, 16)
    assert keep_global_batch(_Accelerator(), {"world_size": 1, "gradient_accumulation_steps": 3}) is None
    three = _Accelerator()
    three.num_processes = 3
    with pytest.raises(ValueError, match="global batch of 4 micro-batches cannot be split over 3 processes"):
        keep_global_batch(three, {"world_size": 2, "gradient_accumulation_steps": 2})
    accelerator = _Accelerator()
    accelerator.step = 3
    with pytest.raises(ValueError, match="middle of an accumulation cycle"):
        keep_global_batch(accelerator, {"world_size": 2, "gradient_accumulation_steps": 2})
