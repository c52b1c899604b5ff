"""What the launched Lightning test scripts share: a tiny GPT LightningModule, fixed data, weight snapshots.

The scripts run under Lightning's own launcher (or torchrun) and write their results into an output directory
that the tests read. Sizes divide by neither 2 nor 4, so shards never line up with parameter boundaries.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for lightning_zero/zero_core
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support, for the shared model pieces

import zero_core  # noqa: E402
from models import D_MODEL, SEQ, VOCAB, Block  # noqa: E402

# No zero_core persistence: every parameter is partitioned at stage 3 (small models are otherwise whole).
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 700}


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        nn.init.normal_(self.tok.weight, std=0.1)
        nn.init.normal_(self.pos.weight, std=0.1)
        self.head.weight = self.tok.weight  # tied

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Tokens(Dataset):
    def __init__(self, count: int = 44, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (count, SEQ + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class LitGPT(pl.LightningModule):
    """Automatic optimization, AdamW + a step-interval scheduler, torchmetrics logged with sync_dist."""

    def __init__(self, lr: float = 0.01, in_configure_model: bool = False, interval: str = "step"):
        super().__init__()
        self.save_hyperparameters()
        self.model = None if in_configure_model else self._build()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(VOCAB, average="micro")

    @staticmethod
    def _build():
        torch.manual_seed(0)
        return TinyGPT()

    def configure_model(self):
        if self.model is None:
            self.model = self._build()

    def loss(self, batch):
        tokens, targets = batch
        logits = self.model(tokens)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)), logits, targets

    def training_step(self, batch, batch_idx):
        loss, logits, targets = self.loss(batch)
        self.train_acc(logits.argmax(-1), targets)
        self.log("train_loss", loss, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, targets = self.loss(batch)
        self.val_acc(logits.argmax(-1), targets)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        loss, _, _ = self.loss(batch)
        self.log("test_loss", loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.loss(batch)[0].detach()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.interval}}


def loader(batch_size: int = 4, count: int = 44, shuffle: bool = True) -> DataLoader:
    return DataLoader(Tokens(count), batch_size=batch_size, shuffle=shuffle)


def full_weights(module: nn.Module) -> dict:
    """Every parameter whole, fp32 (a collective under ZeRO stage 3)."""
    with zero_core.GatheredParameters(list(module.parameters())):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def save_rank(out: Path, label: str, obj) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(obj, out / f"{label}.rank{rank}.pt")


def write_json(out: Path, label: str, obj) -> None:
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        (out / f"{label}.json").write_text(json.dumps(obj, indent=1, default=float))


def metrics(trainer) -> dict:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def message_of(fn) -> str:
    try:
        fn()
    except Exception as error:  # every rank raises the same error at the same point
        return f"{type(error).__name__}: {error}"
    return "no error"


def trainer(strategy, out: Path, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=int(os.environ.get("TEST_DEVICES", 2)), max_epochs=2,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, default_root_dir=str(out))
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)
