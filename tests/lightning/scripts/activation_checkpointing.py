"""``activation_checkpointing_policy`` of ZeroStrategy and ZeroFabricStrategy at stage 3 (full partitioning) with
the config's ``cpu_checkpointing``, each against DDP with plain ``torch.utils.checkpoint`` on the same blocks.

    python tests/lightning/scripts/activation_checkpointing.py OUT_DIR     (Lightning's launcher starts rank 1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from lightning.fabric import Fabric
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from common import STAGE3, VOCAB, LitGPT, TinyGPT, full_weights, loader, save_rank, trainer, write_json
from models import Block

from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from zero_core import checkpointing

OUT = Path(sys.argv[1])
CPU_CHECKPOINTS = {"zero_optimization": STAGE3, "activation_checkpointing": {"cpu_checkpointing": True}}


class TorchCheckpointedGPT(TinyGPT):
    """The reference: each block under plain torch.utils.checkpoint."""

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


class LitTorchCheckpointed(LitGPT):
    @staticmethod
    def _build():
        torch.manual_seed(0)
        return TorchCheckpointedGPT()


def stats() -> dict:
    return {k: v for k, v in vars(checkpointing.current().stats).items() if k in ("stashed", "restored", "host_bytes")}


def lightning() -> dict:
    reference = LitTorchCheckpointed()
    trainer(STRATEGY_DDP, OUT, max_epochs=1).fit(reference, loader())
    save_rank(OUT, "trainer_ddp", full_weights(reference))
    model = LitGPT()
    strategy = ZeroStrategy(config=CPU_CHECKPOINTS, activation_checkpointing_policy={Block})
    trainer(strategy, OUT, max_epochs=1).fit(model, loader())
    save_rank(OUT, "trainer_zero3", full_weights(model))
    forwards = [type(block.__dict__.get("forward")).__name__ for block in model.model.blocks]
    return {"stats": stats(), "forwards": forwards, "stage": strategy.stage}


def fabric_train(strategy, model_class):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        torch.manual_seed(0)
        model = model_class()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for x, y in fabric.setup_dataloaders(loader()):
        fabric.backward(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    return model


def fabric() -> dict:
    save_rank(OUT, "fabric_ddp", full_weights(fabric_train("ddp", TorchCheckpointedGPT).module))
    strategy = ZeroFabricStrategy(config=CPU_CHECKPOINTS, activation_checkpointing_policy=ModuleWrapPolicy({Block}))
    save_rank(OUT, "fabric_zero3", full_weights(fabric_train(strategy, TinyGPT).module))
    return {"stats": stats()}


STRATEGY_DDP = "ddp"

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    found = {"lightning": lightning(), "fabric": fabric()}
    write_json(OUT, "activation_checkpointing", found)
    dist.barrier()
