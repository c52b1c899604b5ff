"""Lightning under ``torchrun --max-restarts 1``: rank 1 is SIGKILLed after step 7; the restarted job connects
(its process group never reads the dead attempt's store keys), resumes from the newest checkpoint (step 6),
and ends with the uninterrupted run's weights. Both ways to resume: ``fit(ckpt_path="last")`` and
``ZeroStrategy(resume="latest")``. The same for Fabric with ``zero_core.latest_checkpoint``."""

from __future__ import annotations

import pytest
import torch

from distributed import _free_port
from restarts import REPO, assert_weights_equal, launch, torchrun, uninterrupted_weights

SCRIPT = REPO / "tests" / "lightning_scripts" / "crash_resume.py"
STEPS, KILL_AFTER = 10, 6  # checkpoints every 3 steps: the restart resumes at step 6


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["zero3", "zero3-latest"])
def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path, kind):
    launch(torchrun(SCRIPT, str(tmp_path), str(KILL_AFTER), kind, port=_free_port()), timeout=120, cwd=tmp_path)
    result = torch.load(tmp_path / "result.pt")
    assert (result["attempt"], result["resumed_at"], result["global_step"]) == (1, 6, STEPS), result
    got = {k.removeprefix("net."): v for k, v in result["weights"].items()}
    assert_weights_equal(got, uninterrupted_weights(STEPS))


@pytest.mark.timeout(150)
def test_fabric_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path):
    script = REPO / "tests" / "lightning_scripts" / "fabric_crash_resume.py"
    launch(torchrun(script, str(tmp_path), "4", port=_free_port()), timeout=120, cwd=tmp_path)
    result = torch.load(tmp_path / "result.pt")
    assert (result["attempt"], result["resumed_at"]) == (1, 4), result  # killed after step 5, saved at 4
    assert_weights_equal(result["weights"], uninterrupted_weights(8))
