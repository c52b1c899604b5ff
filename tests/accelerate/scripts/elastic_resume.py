"""An Accelerate loop that resumes at another world size, for tests/accelerate/test_accelerate_elastic.py: what a torchrun
``--nnodes MIN:MAX`` restart after a lost node does (the same script, ``load_state()``, fewer processes).

Usage: elastic_resume.py OUT_DIR MAX_STEPS under torchrun. Every attempt builds the Accelerator with
gradient_accumulation_steps=1 and saves its state (automatic_checkpoint_naming) every 2 steps; each micro-batch
is drawn from (step, its slot in the global batch: process x accumulation + micro-batch index), so a run that
keeps the global batch equals a fixed-size one. Rank 0 writes the weights, the step it resumed at and the
accumulation it ran with to OUT_DIR/result-<world size>.pt.
"""

import sys
from pathlib import Path

import torch
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from restarts import batch, make_model  # noqa: E402

CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


class Counter:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main(out: Path, max_steps: int) -> None:
    torch.set_num_threads(1)
    project = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True)
    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(config=CONFIG), project_config=project,
                                  gradient_accumulation_steps=1)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    if (out / "checkpoints").is_dir():
        accelerator.load_state()
    resumed_at, accumulation = counter.step, accelerator.gradient_accumulation_steps
    for step in range(counter.step, max_steps):
        for micro in range(accumulation):
            with accelerator.accumulate(model):
                slot = accelerator.process_index * accumulation + micro
                accelerator.backward(model(batch(step, slot)).pow(2).mean())  # divided by the accumulation
                optimizer.step()
                optimizer.zero_grad()
        counter.step = step + 1
        if counter.step % 2 == 0:
            accelerator.save_state()
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({"weights": weights, "resumed_at": resumed_at, "accumulation": accumulation},
                   out / f"result-{accelerator.num_processes}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
