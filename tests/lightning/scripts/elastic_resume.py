"""A Lightning fit that resumes at another world size, for tests/lightning/test_lightning_elastic.py: what a torchrun
``--nnodes MIN:MAX`` restart after a lost node does (the same script, ``fit(ckpt_path="last")``, fewer ranks).

Usage: python elastic_resume.py OUT_DIR DEVICES MAX_STEPS (Lightning's launcher starts the other ranks). Every
attempt passes accumulate_grad_batches=1; each micro-batch is drawn from (global step, its slot in the global
batch: rank x accumulation + micro-batch index), so a run that keeps the global batch equals a fixed-size one.
Rank 0 writes the weights, the step it resumed at and the accumulation it ran with to OUT_DIR/result-DEVICES.pt.
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for lightning_zero/zero_core
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

from lightning_zero import ZeroStrategy  # noqa: E402
from restarts import batch, make_model  # noqa: E402

CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.resumed_at = None
        self._step_seen, self._micro = None, 0

    def training_step(self, _batch, _index):
        if self.resumed_at is None:
            self.resumed_at = self.global_step
        if self._step_seen != self.global_step:
            self._step_seen, self._micro = self.global_step, 0
        slot = self.global_rank * self.trainer.accumulate_grad_batches + self._micro
        self._micro += 1
        return self.net(batch(self.global_step, slot)).pow(2).mean()  # Lightning divides by the accumulation

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path, devices: int, max_steps: int) -> None:
    torch.set_num_threads(1)
    saver = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=ZeroStrategy(config=CONFIG),
                         max_steps=max_steps, accumulate_grad_batches=1, callbacks=[saver], logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    data = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)  # only paces the loop
    trainer.fit(model, data, ckpt_path="last")
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        torch.save({"weights": {k.removeprefix("net."): v.detach().cpu().clone() for k, v in state.items()},
                    "resumed_at": model.resumed_at, "accumulation": trainer.accumulate_grad_batches,
                    "global_step": trainer.global_step}, out / f"result-{devices}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
