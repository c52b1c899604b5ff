"""A pretrained Hugging Face model fine-tuned by the Trainer: ``from_pretrained`` in ``configure_model``.

    python tests/lightning/scripts/pretrained.py MODEL_DIR OUT_DIR   (Lightning's launcher starts rank 1)

Under ``zero3`` ``configure_model`` runs inside ``zero_core.Init``, so the model is built already partitioned,
each rank reading only its own slices of the weight files; DDP loads it whole. Both train 6 steps. Then, under
``zero3``, rank 0 alone calls the model's ``save_pretrained`` (as a DDP script would): the strategy's check
refuses it before writing anything; the recipe its error names (``GatheredParameters`` on every rank, saving on
rank 0 inside it) writes the trained weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from common import STAGE3, full_weights, save_rank, trainer, write_json

import lightning_zero  # noqa: F401
import zero_core
from lightning_zero import ZeroStrategy

MODEL, OUT = Path(sys.argv[1]), Path(sys.argv[2])


class LitPretrained(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.loaded_as = None

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_pretrained(MODEL)
            self.loaded_as = type(self.model.lm_head.weight).__name__

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data() -> DataLoader:
    ids = torch.randint(0, 96, (24, 8), generator=torch.Generator().manual_seed(5))
    return DataLoader(ids, batch_size=2, shuffle=False)


def main() -> None:
    results = {}
    for name, strategy in [("ddp", "ddp"), ("zero3", ZeroStrategy(config=STAGE3))]:
        module = LitPretrained()
        fit = trainer(strategy, OUT, max_steps=6, max_epochs=1)
        fit.fit(module, data())
        save_rank(OUT, f"pretrained_{name}", full_weights(module.model) if name == "zero3" else
                  {n: p.detach().float().clone() for n, p in module.model.named_parameters()})
        results[name] = module.loaded_as
    results["rank0_save_error"] = save_on_rank0_alone(module.model, OUT / "rank0_alone")
    with zero_core.GatheredParameters(list(module.model.parameters())):  # every rank
        if dist.get_rank() == 0:
            module.model.save_pretrained(OUT / "gathered")
    write_json(OUT, "pretrained", results)


def save_on_rank0_alone(model, directory: Path):
    """A DDP script's save, on the stage 3 model: the error it raised on rank 0 (rank 1 does nothing)."""
    if dist.get_rank() != 0:
        return None
    try:
        model.save_pretrained(directory)
        return None
    except RuntimeError as error:
        return str(error)


if __name__ == "__main__":
    main()
