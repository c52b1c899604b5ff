"""Lightning's BackboneFinetuning (backbone frozen at fit start, added to the optimizer at epoch 1 through
``optimizer.add_param_group``, its learning rate raised each epoch after) under zero1/zero2/zero3.

    python tests/lightning/scripts/finetuning.py OUT_DIR   (Lightning's launcher starts rank 1)

Then DDP, zero1 and zero3 resume the third epoch from a checkpoint saved after the unfreezing (Lightning restores
the backbone's group; as under DDP, the backbone stays frozen after a resume). The reference is DDP, which averages only the parameters that required a gradient when it wrapped the model: the
backbone was frozen then, so the reference module averages the backbone's gradients itself (on_after_backward),
as DDP would have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from common import STAGE3, full_weights, save_rank, trainer, write_json

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy

OUT = Path(sys.argv[1])
SAMPLES = 44


class LitBackbone(pl.LightningModule):
    def __init__(self, average_backbone: bool = False) -> None:
        super().__init__()
        self.average_backbone = average_backbone
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 10), nn.LayerNorm(10))
        self.head = nn.Linear(10, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)).squeeze(-1), y)

    def on_after_backward(self) -> None:
        if self.average_backbone:
            for param in self.backbone.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    param.grad /= dist.get_world_size()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.head.parameters(), lr=1e-2, weight_decay=0.1)


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 6, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(-1).sin()), batch_size=4, shuffle=False)


def finetuning() -> BackboneFinetuning:
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, should_align=True)


def fit(strategy, label: str) -> dict:
    model = LitBackbone(average_backbone=strategy == "ddp")
    run = trainer(strategy, OUT, max_epochs=3, callbacks=[finetuning()])
    run.fit(model, data())
    save_rank(OUT, label, full_weights(model))
    groups = run.optimizers[0].param_groups
    return {"lrs": [g["lr"] for g in groups], "group_sizes": [len(g["params"]) for g in groups],
            "global_step": run.global_step}


def fit_then_resume(make_strategy, label: str) -> None:
    """Two epochs (the backbone unfrozen at the second), saved; a perturbed module resumes for the third."""
    model = LitBackbone(average_backbone=label == "ddp")
    first = trainer(make_strategy(), OUT, max_epochs=2, callbacks=[finetuning()])
    first.fit(model, data())
    checkpoint = OUT / f"finetune_{label}_epoch1.ckpt"
    first.save_checkpoint(checkpoint)
    resumed = LitBackbone(average_backbone=label == "ddp")
    with torch.no_grad():
        for param in resumed.parameters():
            param.add_(0.5)  # the checkpoint must bring every weight back
    second = trainer(make_strategy(), OUT, max_epochs=3, callbacks=[finetuning()])
    second.fit(resumed, data(), ckpt_path=str(checkpoint))
    save_rank(OUT, f"finetune_{label}_resumed", full_weights(resumed))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, strategy in (("ddp", "ddp"), ("zero1", ZeroStrategy(stage=1)), ("zero2", ZeroStrategy(stage=2)),
                           ("zero3", ZeroStrategy(stage=3, config=STAGE3))):
        results[name] = fit(strategy, f"finetune_{name}")
    write_json(OUT, "finetune", results)
    fit_then_resume(lambda: "ddp", "ddp")
    fit_then_resume(lambda: ZeroStrategy(stage=1), "zero1")
    fit_then_resume(lambda: ZeroStrategy(stage=3, config=STAGE3), "zero3")
