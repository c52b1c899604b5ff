"""Accelerate keeps the global batch when ``load_state()`` resumes at a smaller world size (a torchrun
``--nnodes MIN:MAX`` restart after a lost node): 4 steps on 2 processes with gradient_accumulation_steps=1 save
their state; the same script resumed on 1 process runs with accumulation 2 and ends, after 8 steps, with the
weights of a fixed-size run on the same global batches. The same for an ordinary Hugging Face Trainer script
under ``-m accelerate_zero.swap`` resumed with ``train(resume_from_checkpoint=True)``. The re-planning's
refusals are tested beside them."""

from __future__ import annotations

import json
import types

import pytest
import torch

from accelerate_zero.elastic import keep_global_batch, keep_trainer_global_batch
from launch import ACCELERATE_SCRIPTS, free_port
from restarts import assert_weights_equal, launch, torchrun, uninterrupted_weights

SCRIPT = ACCELERATE_SCRIPTS / "elastic_resume.py"
HF_SCRIPT = ACCELERATE_SCRIPTS / "hf_elastic_resume.py"
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


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


@pytest.mark.timeout(200)
def test_hf_trainer_resumed_on_fewer_processes_keeps_the_global_batch_and_the_weights(tmp_path, monkeypatch):
    """checkpoint-4 of 2 processes x accumulation 1 resumes on 1 process with accumulation 2, skipping the 8
    micro-batches of steps 0-3 (without the re-planning it would skip 4 and step on half batches)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("ACCELERATE_ZERO_CONFIG", json.dumps(CONFIG))
    out = tmp_path / "out"
    launch(torchrun(HF_SCRIPT, str(out), "4", port=free_port(), restarts=0, nproc=2, swap=True), timeout=90,
           cwd=tmp_path)
    assert torch.load(out / "result-2.pt")["accumulation"] == 1
    saved = json.loads((out / "checkpoint-4" / "zero_state.json").read_text())["global_batch"]
    assert saved == {"world_size": 2, "gradient_accumulation_steps": 1}, saved
    launch(torchrun(HF_SCRIPT, str(out), "8", port=free_port(), restarts=0, nproc=1, swap=True), timeout=90,
           cwd=tmp_path)
    second = torch.load(out / "result-1.pt")
    assert (second["resumed_at"], second["accumulation"]) == (4, 2), second
    assert_weights_equal(second["weights"], uninterrupted_weights(8, weight_decay=0.0))


def test_trainer_replanning_sets_its_arguments_or_says_why_not():
    def trainer(processes: int):
        accelerator = types.SimpleNamespace(num_processes=processes, is_main_process=True)
        return types.SimpleNamespace(accelerator=accelerator,
                                     args=types.SimpleNamespace(gradient_accumulation_steps=1))

    one = trainer(1)
    assert keep_trainer_global_batch(one, {"world_size": 4, "gradient_accumulation_steps": 2}) == 8
    assert one.args.gradient_accumulation_steps == 8
    assert keep_trainer_global_batch(one, {"world_size": 1, "gradient_accumulation_steps": 3}) is None
    assert one.args.gradient_accumulation_steps == 8  # the same size: the user's own choice stays
    with pytest.raises(ValueError, match=r"Trainer.train\(resume_from_checkpoint\) resumes on 3 processes .* "
                                         "global batch of 4 micro-batches cannot be split over 3 processes"):
        keep_trainer_global_batch(trainer(3), {"world_size": 2, "gradient_accumulation_steps": 2})


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
