"""A Lightning fit under two torchrun agents as two nodes (``--nnodes 1:2``, one rank each), for
tests/lightning/test_lightning_elastic.py: when a node is lost, torchrun restarts the fit on the other one, where
``ZeroStrategy(resume="latest")`` resumes from the newest verified checkpoint and keeps the global batch by
accumulating twice as many micro-batches (elastic_resume.py's model and batches).

Usage: elastic_nodes.py OUT_DIR MAX_STEPS STEP_S under torchrun. Lightning's ``num_nodes`` must match the world
torchrun gave this attempt, so it comes from the environment. On two nodes every step sleeps STEP_S (room for
the test to kill one mid-run). Rank 0 appends (attempt, world size, accumulation, resumed step) to
OUT_DIR/starts.jsonl at its first step and writes the final weights to OUT_DIR/result.pt.
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for lightning_zero/zero_core

from elastic_resume import CONFIG, Net  # noqa: E402  (this folder: the model and its batches)
from lightning_zero import ZeroStrategy  # noqa: E402


class PacedNet(Net):
    def __init__(self, out: Path, step_s: float):
        super().__init__()
        self.out, self.step_s = out, step_s

    def training_step(self, batch, index):
        if self.resumed_at is None and self.global_rank == 0:
            with (self.out / "starts.jsonl").open("a") as f:
                f.write(json.dumps({"attempt": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                                    "world": self.trainer.world_size, "resumed_at": self.global_step,
                                    "accumulation": self.trainer.accumulate_grad_batches}) + "\n")
        if self.trainer.world_size > 1:
            time.sleep(self.step_s)
        return super().training_step(batch, index)


def main(out: Path, max_steps: int, step_s: float) -> None:
    torch.set_num_threads(1)
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    saver = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=int(os.environ["WORLD_SIZE"]) // devices,
                         strategy=ZeroStrategy(config=CONFIG, resume="latest"), max_steps=max_steps,
                         accumulate_grad_batches=1, callbacks=[saver], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = PacedNet(out, step_s)
    trainer.fit(model, DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1))  # the data only paces
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        torch.save({k.removeprefix("net."): v.detach().cpu().clone() for k, v in state.items()}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
