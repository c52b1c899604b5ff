"""A compiled LightningModule (``Trainer.fit(torch.compile(module))``) and a compiled Fabric model under ZeRO,
each against the same compiled run under DDP.

    python tests/lightning/scripts/compiled.py OUT_DIR     (Lightning's launcher starts the 2nd rank)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

from torch._dynamo.utils import counters

from common import STAGE3, VOCAB, LitGPT, TinyGPT, full_weights, loader, save_rank, trainer, write_json

import lightning_zero  # noqa: F401
from lightning_zero import ZeroFabricStrategy, ZeroStrategy

OUT = Path(sys.argv[1])
BACKEND = "aot_eager"  # fast on CPU; the engine's hooks are the same under inductor


class LitCompiled(LitGPT):
    """No torchmetrics and no ``self.log`` in the compiled step: torch 2.13's dynamo fails on both inside a
    compiled ``training_step``, under DDP as well."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch)[0]


GRAPHS = {}  # compiled graphs per run: proof that compilation happened


def trainer_runs() -> None:
    for name, strategy in (("ddp", lambda: "ddp"), ("zero1", lambda: ZeroStrategy(stage=1)),
                           ("zero2", lambda: ZeroStrategy(stage=2)),
                           ("zero3", lambda: ZeroStrategy(stage=3, config=STAGE3))):
        torch._dynamo.reset()
        counters.clear()
        model = LitCompiled()
        trainer(strategy(), OUT, max_steps=4).fit(torch.compile(model, backend=BACKEND), loader())
        GRAPHS[f"trainer_{name}"] = counters["stats"]["unique_graphs"]
        save_rank(OUT, f"trainer_{name}", full_weights(model))


def fabric_runs() -> None:
    for name, strategy in (("ddp", lambda: "ddp"), ("zero1", lambda: ZeroFabricStrategy(stage=1)),
                           ("zero2", lambda: ZeroFabricStrategy(stage=2)),
                           ("zero3", lambda: ZeroFabricStrategy(stage=3, config=STAGE3))):
        torch._dynamo.reset()
        counters.clear()
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        torch.manual_seed(0)
        model = TinyGPT()
        compiled, optimizer = fabric.setup(torch.compile(model, backend=BACKEND),
                                           torch.optim.AdamW(model.parameters(), lr=0.01))
        for i, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
            fabric.backward(F.cross_entropy(compiled(x).reshape(-1, VOCAB), y.reshape(-1)))
            optimizer.step()
            optimizer.zero_grad()
            if i == 3:
                break
        GRAPHS[f"fabric_{name}"] = counters["stats"]["unique_graphs"]
        save_rank(OUT, f"fabric_{name}", full_weights(model))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    trainer_runs()
    fabric_runs()
    write_json(OUT, "graphs", GRAPHS)
    dist.barrier()
