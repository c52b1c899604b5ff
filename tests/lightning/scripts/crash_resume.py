"""A Lightning job that checkpoints every 3 steps and resumes by itself after crashes; for
tests/lightning/test_lightning_restarts.py, launched by ``torchrun --nproc-per-node 2 --max-restarts 2``.

Usage: python crash_resume.py OUT_DIR KILLS, KILLS like "4:1,7:0": in attempt i (TORCHELASTIC_RESTART_COUNT)
the i-th pair's rank SIGKILLs itself after that optimizer step ("-": no kill). Attempts 0 and 1 resume with
``fit(ckpt_path="last")``, later attempts with ``ZeroStrategy(resume="latest")`` and no ckpt_path, so one job
exercises both. The batches come from (global step, rank), so a resumed run sees the data an uninterrupted one
does. Rank 0 writes the final weights and the step the last attempt resumed at to OUT_DIR/result.pt.
"""

import os
import signal
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

STEPS = 10  # tests/lightning/test_lightning_restarts.py counts on these
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}


class Net(pl.LightningModule):
    def __init__(self, kill: tuple):
        super().__init__()
        self.net = make_model()
        self.kill = kill  # (after step, rank) or None
        self.resumed_at = None

    def training_step(self, _batch, _index):
        if self.resumed_at is None:
            self.resumed_at = self.global_step
        return self.net(batch(self.global_step, self.global_rank)).pow(2).mean()

    def on_train_batch_end(self, *args):
        if self.kill is not None and (self.global_step - 1, self.global_rank) == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exception, no cleanup

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path, kills: list) -> None:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    by_itself = attempt >= 2
    strategy = ZeroStrategy(config=CONFIG, resume="latest" if by_itself else None)
    saver = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[saver],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net(kills[attempt] if attempt < len(kills) else None)
    data = DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)  # only paces the loop
    trainer.fit(model, data, ckpt_path=None if by_itself else "last")
    state = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank == 0:
        torch.save({"weights": {k: v.detach().cpu().clone() for k, v in state.items()}, "attempt": attempt,
                    "resumed_at": model.resumed_at, "global_step": trainer.global_step}, out / "result.pt")


def parse_kills(text: str) -> list:
    return [None if pair == "-" else tuple(int(v) for v in pair.split(":")) for pair in text.split(",")]


if __name__ == "__main__":
    main(Path(sys.argv[1]), parse_kills(sys.argv[2]))
