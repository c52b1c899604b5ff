"""An Accelerate loop that saves with ``automatic_checkpoint_naming`` every 2 steps and resumes with
``load_state()``; for tests/accelerate/test_accelerate_restarts.py, under ``accelerate launch --max_restarts 1``.

Usage: crash_resume.py OUT_DIR KILL_AFTER_STEP (-1: never). On the first attempt rank 1 SIGKILLs itself after step
KILL_AFTER_STEP. Rank 0 writes the final weights and the step it resumed at to OUT_DIR/result.pt.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

import zero_core  # noqa: E402
from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from restarts import batch, make_model  # noqa: E402

STEPS, SAVE_EVERY = 8, 2
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


class Counter:
    """The step, saved and restored with the state (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main(out: Path, kill_after: int) -> None:
    torch.set_num_threads(1)
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=3)
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(config=CONFIG), project_config=project)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if (out / "checkpoints").is_dir():
        accelerator.load_state()
    resumed_at, attempt = counter.step, zero_core.restart_attempt()
    for step in range(counter.step, STEPS):
        accelerator.backward(model(batch(step, accelerator.process_index)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        counter.step = step + 1
        if counter.step % SAVE_EVERY == 0:
            accelerator.save_state()
        if attempt == 0 and accelerator.process_index == 1 and step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({"weights": weights, "attempt": attempt, "resumed_at": resumed_at,
                    "saved": sorted(p.name for p in (out / "checkpoints").iterdir())}, out / "result.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
