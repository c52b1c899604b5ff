"""Lightning under ``torchrun --max-restarts 2``: rank 1 is SIGKILLed after step 4, then rank 0 after step 7;
each restarted attempt connects (its process group never reads a dead attempt's store keys; before, the
restart hung), resumes from the newest checkpoint (steps 3, then 6), the first time with
``fit(ckpt_path="last")``, the second with ``ZeroStrategy(resume="latest")``, and the job ends with the
uninterrupted run's weights. The same for Fabric with ``zero_core.latest_checkpoint``."""

from __future__ import annotations

import pytest
import torch

from launch import LIGHTNING_SCRIPTS, free_port
from restarts import assert_weights_equal, launch, torchrun, uninterrupted_weights

SCRIPT = LIGHTNING_SCRIPTS / "crash_resume.py"
STEPS = 10  # checkpoints every 3 steps


@pytest.mark.timeout(150)
def test_killed_ranks_restart_and_resume_to_the_uninterrupted_weights(tmp_path):
    command = torchrun(SCRIPT, str(tmp_path), "4:1,7:0", port=free_port(), restarts=2)
    launch(command, timeout=140, cwd=tmp_path)
    result = torch.load(tmp_path / "result.pt")
    assert (result["attempt"], result["resumed_at"], result["global_step"]) == (2, 6, STEPS), result
    got = {k.removeprefix("net."): v for k, v in result["weights"].items()}
    assert_weights_equal(got, uninterrupted_weights(STEPS))


@pytest.mark.timeout(150)
def test_fabric_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path):
    script = LIGHTNING_SCRIPTS / "fabric_crash_resume.py"
    launch(torchrun(script, str(tmp_path), "4", port=free_port()), timeout=120, cwd=tmp_path)
    result = torch.load(tmp_path / "result.pt")
    assert (result["attempt"], result["resumed_at"]) == (1, 4), result  # killed after step 5, saved at 4
    assert_weights_equal(result["weights"], uninterrupted_weights(8))
