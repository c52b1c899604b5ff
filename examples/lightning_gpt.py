"""Train a small GPT on generated addition problems with ZeRO stage 3 under the Lightning Trainer.

    python examples/lightning_gpt.py                                    # fit with the defaults: 2 CPU processes
    python examples/lightning_gpt.py fit --config examples/lightning_cli.yaml
    python examples/lightning_gpt.py fit --model.n_layer 8 --model.n_embd 512 --trainer.max_steps 5000 \\
        --trainer.accelerator gpu --trainer.devices 8 --trainer.num_nodes 2 --trainer.precision bf16-mixed
    python examples/lightning_gpt.py fit --print_config                 # every option, as YAML

The text ("12+34=046;" repeated, sums zero-padded to three digits) is generated from a
seed, so nothing is downloaded. The model is built in ``configure_model``, so at stage 3 each rank only ever
holds its share of it. Checkpoints (sharded directories) go to lightning_gpt/checkpoints; at the end the live
weights are exported as 16-bit safetensors to lightning_gpt/model-bf16. The progress bar shows the loss and the
share of answer digits the model gets right on problems it never saw.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from lightning_zero import ZeroStrategy  # noqa: E402  (the import also registers strategy="zero3" etc.)

ALPHABET = "0123456789+=;"
CHAR_ID = {c: i for i, c in enumerate(ALPHABET)}
PROBLEM_LEN = len("12+34=046;")


# -- data ------------------------------------------------------------------------------------------------
class AdditionProblems(Dataset):
    """Sample ``i`` is a window of ``context + 1`` characters of freshly generated problems (fixed by seed, i)."""

    def __init__(self, samples: int, context: int, seed: int):
        self.samples, self.context, self.seed = samples, context, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        rng = random.Random(self.seed * 1_000_003 + index)
        problems = math.ceil((self.context + 1) / PROBLEM_LEN) + 1
        text = "".join(f"{a:02d}+{b:02d}={a + b:03d};" for a, b in
                       ((rng.randrange(100), rng.randrange(100)) for _ in range(problems)))
        start = rng.randrange(PROBLEM_LEN)
        tokens = torch.tensor([CHAR_ID[c] for c in text[start : start + self.context + 1]])
        return tokens[:-1], tokens[1:]


class AdditionData(pl.LightningDataModule):
    def __init__(self, context: int = 32, batch_size: int = 32, train_samples: int = 19_200, val_samples: int = 512,
                 seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, samples: int, seed: int, shuffle: bool) -> DataLoader:
        data = AdditionProblems(samples, self.hparams.context, seed)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.train_samples, self.hparams.seed, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.val_samples, self.hparams.seed + 1, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.val_samples, self.hparams.seed + 2, shuffle=False)


# -- model -----------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, an LM head tied to the token embedding."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LitGPT(pl.LightningModule):
    def __init__(self, n_layer: int = 3, n_head: int = 4, n_embd: int = 96, context: int = 32, lr: float = 3e-3,
                 weight_decay: float = 0.1, warmup_steps: int = 50, compile: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.gpt = None
        self.answer_accuracy = torchmetrics.MeanMetric()

    def configure_model(self) -> None:
        # Under ZeRO stage 3 this runs inside zero_core.Init: each layer is partitioned as soon as it is built.
        if self.gpt is None:
            h = self.hparams
            self.gpt = GPT(len(ALPHABET), h.context, h.n_embd, h.n_layer, h.n_head)
            if h.compile:  # --model.compile true: each block compiled (torchtitan's recipe; see docs/stage3.md)
                for block in self.gpt.blocks:
                    block.compile()

    def _loss(self, batch):
        inputs, targets = batch
        logits = self.gpt(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()), logits, inputs, targets

    def training_step(self, batch, batch_idx):
        loss, *_ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, inputs, targets = self._loss(batch)
        right = (logits.argmax(-1) == targets)[answer_positions(inputs, targets)]
        self.answer_accuracy.update(right.float())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_answer_acc", self.answer_accuracy, prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]  # weight decay on matrices only: two groups
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        total, warmup = max(1, int(self.trainer.estimated_stepping_batches)), self.hparams.warmup_steps
        schedule = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def answer_positions(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Where the target is an answer digit: the three characters after '='."""
    mask = torch.zeros_like(inputs, dtype=torch.bool)
    for offset in range(3):
        mask[:, offset:] |= inputs[:, : inputs.shape[1] - offset] == CHAR_ID["="]
    return mask & (targets != CHAR_ID[";"])


class Export16Bit(pl.Callback):
    """After fit, every rank helps write the live weights as 16-bit safetensors (no rank holds the whole model)."""

    def __init__(self, dirpath: str = "lightning_gpt/model-bf16", dtype: str = "bf16"):
        self.dirpath, self.dtype = dirpath, dtype

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(trainer.strategy, "save_16bit_model"):
            rank_zero_info(f"Export16Bit: {type(trainer.strategy).__name__} is not a ZeroStrategy; nothing exported")
            return
        if trainer.strategy.save_16bit_model(self.dirpath, dtype=self.dtype):
            rank_zero_info(f"16-bit weights ({self.dtype}) written to {Path(self.dirpath).absolute()}")


TRAINER_DEFAULTS = {
    "accelerator": "cpu",
    "devices": 2,
    # Parameters under 1,000 elements (biases, norms) stay whole; every matrix is partitioned across the ranks.
    "strategy": lazy_instance(ZeroStrategy, stage=3, config={"stage3_param_persistence_threshold": 1000,
                                                             "stage3_gather_16bit_weights_on_model_save": True}),
    "max_steps": 600,
    "val_check_interval": 150,
    "gradient_clip_val": 1.0,
    "log_every_n_steps": 20,
    "default_root_dir": "lightning_gpt",
}


class GPTCLI(LightningCLI):
    """Checkpointing and the 16-bit export are options too: --checkpoint.* and --export.*."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.dirpath": "lightning_gpt/checkpoints", "checkpoint.monitor": "val_loss",
                             "checkpoint.save_top_k": 2, "checkpoint.save_last": "link",
                             "checkpoint.filename": "{step}-{val_loss:.3f}"})
        parser.add_lightning_class_args(Export16Bit, "export")


def main(args=None) -> LightningCLI:
    torch.set_num_threads(1)  # one thread per process: the 2 processes share the machine's cores
    if args is None and len(sys.argv) == 1:
        args = ["fit"]  # `python examples/lightning_gpt.py` trains with the defaults
    return GPTCLI(LitGPT, AdditionData, trainer_defaults=TRAINER_DEFAULTS, seed_everything_default=0,
                        save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
