"""An ordinary Hugging Face ``Trainer`` script that resumes at another world size, for
tests/accelerate/test_accelerate_elastic.py: what a torchrun ``--nnodes MIN:MAX`` restart after a lost node does
(the same script, ``train(resume_from_checkpoint=True)``, fewer processes), run under ``-m accelerate_zero.swap``.

Usage: hf_elastic_resume.py OUT_DIR MAX_STEPS. Every attempt passes gradient_accumulation_steps=1 and saves
every 2 steps. The sampler is sequential and sample i is row i % 4 of batch(i // 8, i // 4 % 2), so a global
step of 8 samples is batch(step, 0) and batch(step, 1) however it is split over processes and micro-batches,
and a run that keeps the global batch equals the fixed-size reference (tests/support/restarts.py). Rank 0
writes the weights, the step it resumed at and the accumulation it ran with to OUT_DIR/result-<world size>.pt.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

from restarts import batch, make_model  # noqa: E402


class Samples(torch.utils.data.Dataset):
    def __init__(self, steps: int):
        self.steps = steps

    def __len__(self):
        return 8 * self.steps

    def __getitem__(self, index):
        return {"x": batch(index // 8, index // 4 % 2)[index % 4]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return {"loss": self.net(x).pow(2).mean()}  # the Trainer divides by the accumulation


def main(out: Path, max_steps: int) -> None:
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, save_strategy="steps",
                             per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             train_sampling_strategy="sequential", learning_rate=1e-2, weight_decay=0.0,
                             lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], seed=0, use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=Net(), args=args, train_dataset=Samples(8))
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    trainer.train(resume_from_checkpoint=True if last is not None else None)
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_world_process_zero():
        torch.save({"weights": {k.removeprefix("net."): v for k, v in weights.items()},
                    "resumed_at": int(Path(last).name.rpartition("-")[2]) if last else 0,
                    "accumulation": args.gradient_accumulation_steps},
                   out / f"result-{trainer.accelerator.num_processes}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
