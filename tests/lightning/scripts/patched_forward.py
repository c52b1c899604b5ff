"""A forward installed on the model instance (as TRL's fused LM head: ``functools.wraps`` of the class's forward,
the head's weight read directly) under ``ZeroStrategy`` stage 3, against DDP, in 32-true and bf16-mixed.

    python tests/lightning/scripts/patched_forward.py OUT_DIR   (Lightning's launcher starts rank 1)

The inner model is patched before ``fit``, or in ``on_train_start`` (after the strategy set the engine up).
Stage 3 runs with every parameter partitioned and no root group (``max_live_parameters`` too small for it), so
the head is gathered when the patched forward reads it. Each rank saves its weights; rank 0 writes, per run,
whether every forward was the patched one and whether the patch is still on the model after ``fit``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F

from common import STAGE3, LitGPT, TinyGPT, full_weights, loader, save_rank, trainer, write_json

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy

OUT = Path(sys.argv[1])
CONFIG = {**STAGE3, "stage3_max_live_parameters": 100}


def add_fused_head(model: TinyGPT, calls: list) -> None:
    @functools.wraps(type(model).forward)
    def fused(self, tokens):
        calls.append(1)
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.head.weight)  # the head's weight, without calling the head

    model.forward = MethodType(fused, model)


class PatchedGPT(LitGPT):
    def __init__(self, after_setup: bool) -> None:
        super().__init__()
        self.after_setup, self.calls, self.steps = after_setup, [], 0
        if not after_setup:
            add_fused_head(self.model, self.calls)

    def on_train_start(self) -> None:
        if self.after_setup:
            add_fused_head(self.model, self.calls)

    def on_train_batch_end(self, *args) -> None:
        self.steps += 1


def fit(strategy, precision: str, after: bool, label: str) -> dict:
    module = PatchedGPT(after)
    trainer(strategy, OUT, max_epochs=1, precision=precision).fit(module, loader())
    save_rank(OUT, label, full_weights(module))
    forward = module.model.forward
    return {"calls": len(module.calls), "steps": module.steps,
            "still_patched": getattr(forward.__func__, "__wrapped__", None) is TinyGPT.forward}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for precision in ("32-true", "bf16-mixed"):
        results[f"ddp_{precision}"] = fit("ddp", precision, False, f"ddp_{precision}")
        for after in (False, True):
            label = f"zero3_{precision}_{'after' if after else 'before'}"
            results[label] = fit(ZeroStrategy(stage=3, config=CONFIG), precision, after, label)
    write_json(OUT, "patched_forward", results)
