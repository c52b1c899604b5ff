"""Lightning's EMAWeightAveraging under DDP and ZeroStrategy, and the engine's own average at stage 3.

    python tests/lightning/scripts/weight_averaging.py OUT_DIR   (Lightning's launcher starts rank 1)

One epoch of LitGPT with a validation at its end. DDP with EMAWeightAveraging is the reference: its validation
loss (on the average) and its weights after fit (the callback copies the average in at the end). zero1 and
zero2 run the same callback (and resume it from a checkpoint for a second epoch); zero3 with it must refuse with a clear error; zero3 with ``weights_ema_decay`` and
``SwapInWeightsEMA`` validates on the engine's sharded average.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging

from common import STAGE3, LitGPT, full_weights, loader, message_of, metrics, save_rank, trainer, write_json

import zero_core
from lightning_zero import SwapInWeightsEMA, ZeroStrategy

OUT = Path(sys.argv[1])
DECAY = 0.8


class SaveAtEpochEnd(Callback):
    """A checkpoint while training runs (the weights are not the average yet, as they are after fit)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def fit(strategy, callback, epochs: int = 1, ckpt_path=None, save: str = "", **kwargs) -> tuple:
    module = LitGPT()
    callbacks = [callback] + ([SaveAtEpochEnd(OUT / save)] if save else [])
    run = trainer(strategy, OUT, max_epochs=epochs, callbacks=callbacks, num_sanity_val_steps=0,
                  limit_val_batches=2, **kwargs)
    run.fit(module, loader(count=24, shuffle=False), loader(count=16, shuffle=False), ckpt_path=ckpt_path)
    return module, metrics(run)["val_loss"]


def main() -> None:
    results = {}
    runs = (("ddp", "ddp", "32-true"), ("zero1", ZeroStrategy(stage=1), "32-true"),
            ("zero2", ZeroStrategy(stage=2), "32-true"), ("zero2_bf16", ZeroStrategy(stage=2), "bf16-mixed"))
    for name, strategy, precision in runs:  # (in fp32 the masters of stages 1-2 are the parameters' own storage)
        module, results[name] = fit(strategy, EMAWeightAveraging(decay=DECAY), precision=precision,
                                    save=f"{name}.ckpt" if name in ("ddp", "zero2") else "")
        weights = full_weights(module)
        off = 0.0
        if name != "ddp":  # the fp32 masters took the average too (what checkpoints and a later fit use)
            masters = zero_core.engine_of(module).full_state_dict(rank0_only=False)
            off = max((masters[n] - w).abs().max().item() for n, w in weights.items())
        weights["_masters_off"] = torch.tensor(off)
        save_rank(OUT, name, weights)
    for name, strategy in (("ddp", "ddp"), ("zero2", ZeroStrategy(stage=2))):  # resume the callback, 1 more epoch
        module, results[f"{name}_resumed"] = fit(strategy, EMAWeightAveraging(decay=DECAY), epochs=2,
                                                 ckpt_path=str(OUT / f"{name}.ckpt"))
        save_rank(OUT, f"{name}_resumed", full_weights(module))
    results["zero3_callback"] = message_of(lambda: fit(ZeroStrategy(stage=3, config=STAGE3),
                                                       EMAWeightAveraging(decay=DECAY)))
    config = {**STAGE3, "weights_ema_decay": DECAY}
    module, results["zero3_engine"] = fit(ZeroStrategy(stage=3, config=config), SwapInWeightsEMA())
    with zero_core.engine_of(module).ema_weights():
        save_rank(OUT, "zero3_engine", full_weights(module))
    write_json(OUT, "weight_averaging", results)


if __name__ == "__main__":
    main()
