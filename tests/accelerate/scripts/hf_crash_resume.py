"""An ordinary Hugging Face ``Trainer`` script that saves every 2 steps and, when a checkpoint exists, resumes
with ``train(resume_from_checkpoint=True)``; for tests/accelerate/test_accelerate_restarts.py, under
``accelerate launch --max_restarts 1 -m accelerate_zero.swap``.

Usage: hf_crash_resume.py OUT_DIR KILL_AT_STEP (-1: never). On the first attempt rank 1 SIGKILLs itself when the
Trainer has taken KILL_AT_STEP steps. Every sample is the same row, so the uninterrupted run is a plain loop on
that row whatever the sampler's order; rank 0 writes the final weights and the resumed step to OUT_DIR/result.pt.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

from restarts import batch, make_model  # noqa: E402

STEPS, SAVE_EVERY = 8, 2


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"x": batch(0, 0)[0]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return {"loss": self.net(x).pow(2).mean()}


class KillOnce(TrainerCallback):
    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0 and args.process_index == 1 and state.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out: Path, kill_at: int) -> None:
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, save_steps=SAVE_EVERY, save_strategy="steps",
                             per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.0,
                             lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], seed=0, use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0)
    model = Net()
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[KillOnce(kill_at)])
    last = get_last_checkpoint(str(out)) if out.is_dir() else None
    trainer.train(resume_from_checkpoint=True if last is not None else None)
    weights = trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_world_process_zero():
        torch.save({"weights": weights, "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "resumed_from": Path(last).name if last else None}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
