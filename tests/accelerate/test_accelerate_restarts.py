"""Accelerate under ``accelerate launch --max_restarts 1``: rank 1 is SIGKILLed after step 5; the restarted job
connects (the process group of the new attempt never reads the dead one's addresses: without that, gloo's
"connectFullMesh failed ... Connection refused"), ``load_state()`` with ``automatic_checkpoint_naming`` resumes
from the newest complete state (step 4), later saves continue the numbering, and the final weights equal the
uninterrupted run's."""

from __future__ import annotations

import sys

import pytest
import torch

from launch import ACCELERATE_SCRIPTS, free_port
from restarts import assert_weights_equal, batch, launch, uninterrupted_weights

SCRIPT = ACCELERATE_SCRIPTS / "crash_resume.py"
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
mixed_precision: 'no'
main_process_port: {port}
use_cpu: true
"""


@pytest.mark.timeout(150)
def test_killed_rank_restarts_and_load_state_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    config = tmp_path / "accelerate.yaml"
    config.write_text(ACCELERATE_YAML.format(port=free_port()))
    # CPU ranks wherever this runs (a visible GPU would make Accelerate name device local_rank).
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--max_restarts", "1",
            "--monitor_interval", "0.5", str(SCRIPT), str(tmp_path / "out"), "4"], timeout=120, cwd=tmp_path)
    result = torch.load(tmp_path / "out" / "result.pt")
    assert (result["attempt"], result["resumed_at"]) == (1, 4), result
    # saves at steps 2, 4 | crash | 6, 8, numbered on after the resume; total_limit=3 removed the oldest
    assert result["saved"] == ["checkpoint_1", "checkpoint_2", "checkpoint_3"], result["saved"]
    assert_weights_equal(result["weights"], uninterrupted_weights(8))


@pytest.mark.timeout(150)
def test_hf_trainer_killed_rank_restarts_and_resume_from_checkpoint_true_resumes(tmp_path, monkeypatch):
    """The same for an ordinary Hugging Face Trainer script run through ``-m accelerate_zero.swap`` at stage 3:
    ``train(resume_from_checkpoint=True)`` in the restarted attempt resumes from checkpoint-4 (killed at 5)."""
    config = tmp_path / "accelerate.yaml"
    config.write_text(ACCELERATE_YAML.format(port=free_port()))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("ACCELERATE_ZERO_CONFIG",
                       '{"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}')
    script = ACCELERATE_SCRIPTS / "hf_crash_resume.py"
    launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--max_restarts", "1",
            "--monitor_interval", "0.5", "-m", "accelerate_zero.swap", str(script), str(tmp_path / "out"), "5"],
           timeout=120, cwd=tmp_path)
    result = torch.load(tmp_path / "out" / "result.pt")
    assert (result["attempt"], result["resumed_from"]) == (1, "checkpoint-4"), result
    got = {k.removeprefix("net."): v for k, v in result["weights"].items()}
    row = batch(0, 0)[:1]  # every sample is this row (hf_crash_resume.py)
    assert_weights_equal(got, uninterrupted_weights(8, weight_decay=0.0, data=lambda step, rank: row))
