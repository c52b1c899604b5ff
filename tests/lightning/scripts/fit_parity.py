"""Fit DDP and ZeRO 1/2/3 on the same data; checkpoint, resume and convert; write what the test compares.

    python tests/lightning/scripts/fit_parity.py OUT_DIR          (Lightning's launcher starts the 2nd rank)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from common import STAGE3, LitGPT, full_weights, loader, metrics, save_rank, trainer, write_json

import lightning_zero  # noqa: F401  (registers zero1/zero2/zero3)
from lightning_zero import ZeroStrategy, convert_to_single_file

OUT = Path(sys.argv[1])
FIT = dict(accumulate_grad_batches=4, gradient_clip_val=0.05)  # 6 batches/epoch: a partial last window


def strategy_for(name: str):
    if name == "zero3":
        return ZeroStrategy(stage=3, config=STAGE3)
    return name  # "ddp", "zero1", "zero2": the registered names


def run(name: str) -> dict:
    """Fit 2 epochs (checkpoint each epoch, top-1 by val_loss), then validate / test(best) / predict.
    zero3 builds the model in configure_model, so it is partitioned as it is built (zero_core.Init)."""
    model = LitGPT(in_configure_model=name == "zero3")
    every_epoch = ModelCheckpoint(dirpath=OUT / name / "epochs", every_n_epochs=1, save_top_k=-1,
                                  filename="{epoch}", save_last="link")
    best = ModelCheckpoint(dirpath=OUT / name / "best", monitor="val_loss", save_top_k=1, filename="{epoch}")
    callbacks = [best, every_epoch, LearningRateMonitor()]
    t = trainer(strategy_for(name), OUT, enable_checkpointing=True, callbacks=callbacks,
                logger=CSVLogger(str(OUT), name=name), **FIT)
    t.fit(model, loader(), loader(shuffle=False))
    result = {"fit": metrics(t), "global_step": t.global_step, "lr": t.optimizers[0].param_groups[0]["lr"]}
    save_rank(OUT, f"{name}.weights", full_weights(model))
    result["validate"] = t.validate(model, loader(shuffle=False), verbose=False)[0]
    result["test_best"] = t.test(ckpt_path="best", dataloaders=loader(shuffle=False), verbose=False)[0]
    predictions = t.predict(model, loader(shuffle=False))
    save_rank(OUT, f"{name}.predict", torch.stack([p.float() for p in predictions]))
    if name == "zero3":  # saving twice to one path replaces the directory whole
        t.save_checkpoint(OUT / name / "twice.ckpt")
        t.save_checkpoint(OUT / name / "twice.ckpt")
    if name == "zero3":  # a fresh Trainer and module: the sharded checkpoint sets the engine up for testing
        fresh = trainer(strategy_for(name), OUT)
        result["test_fresh"] = fresh.test(LitGPT(), loader(shuffle=False), ckpt_path=best.best_model_path,
                                          verbose=False)[0]
    result["best_files"] = sorted(p.name for p in (OUT / name / "best").iterdir())
    result["epoch_files"] = sorted(p.name for p in (OUT / name / "epochs").iterdir())
    result["optimizer"] = [type(t.optimizers[0]).__name__, type(getattr(t.optimizers[0], "optimizer", None)).__name__]
    write_json(OUT, name, result)
    return result


def resume_zero3() -> None:
    """From the end of epoch 0 to the end of epoch 1 again: must equal the uninterrupted zero3 run."""
    model = LitGPT()
    t = trainer(strategy_for("zero3"), OUT, **FIT)
    t.fit(model, loader(), loader(shuffle=False), ckpt_path=str(OUT / "zero3" / "epochs" / "epoch=0.ckpt"))
    save_rank(OUT, "zero3_resumed.weights", full_weights(model))
    write_json(OUT, "zero3_resumed", {"fit": metrics(t), "global_step": t.global_step})


def resume_zero3_from_ddp() -> None:
    """DDP's single-file epoch-0 checkpoint (weights and optimizer) resumes a zero3 run."""
    model = LitGPT()
    t = trainer(strategy_for("zero3"), OUT, **FIT)
    t.fit(model, loader(), loader(shuffle=False), ckpt_path=str(OUT / "ddp" / "epochs" / "epoch=0.ckpt"))
    save_rank(OUT, "zero3_from_ddp.weights", full_weights(model))


def convert_and_resume_ddp() -> None:
    """The converted epoch-0 file resumes a DDP run; the converted final file loads with load_from_checkpoint."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        convert_to_single_file(OUT / "zero3" / "epochs" / "epoch=0.ckpt", OUT / "zero3_epoch0.ckpt")
        convert_to_single_file(OUT / "zero3" / "epochs" / "last.ckpt", OUT / "zero3_last.ckpt")
        loaded = LitGPT.load_from_checkpoint(OUT / "zero3_last.ckpt")
        torch.save({n: p.detach().clone() for n, p in loaded.named_parameters()}, OUT / "zero3_loaded.pt")
    dist.barrier()
    model = LitGPT()
    t = trainer("ddp", OUT, **FIT)
    t.fit(model, loader(), loader(shuffle=False), ckpt_path=str(OUT / "zero3_epoch0.ckpt"))
    save_rank(OUT, "ddp_from_zero3.weights", full_weights(model))


def resume_last_after_damage() -> None:
    """fit(ckpt_path="last") when last.ckpt (a link to epoch=1.ckpt) is damaged: ZeroStrategy falls back to the
    newest verified checkpoint, epoch=0.ckpt, with a warning, and ends like the uninterrupted run."""
    import json
    import os
    import warnings

    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    shard = OUT / "zero3" / "epochs" / "epoch=1.ckpt" / "shard-00001-of-00002.safetensors"
    expected = json.loads((shard.parent / "manifest.json").read_text())["files"][shard.name]["bytes"]
    os.truncate(shard, expected // 2)  # on both ranks: idempotent
    dist.barrier()
    started = []

    class StartStep(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    every_epoch = ModelCheckpoint(dirpath=OUT / "zero3" / "epochs", every_n_epochs=1, save_top_k=-1,
                                  filename="{epoch}", save_last="link")
    model = LitGPT()
    t = trainer(strategy_for("zero3"), OUT, enable_checkpointing=True, callbacks=[every_epoch, StartStep()], **FIT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(), loader(shuffle=False), ckpt_path="last")
    save_rank(OUT, "zero3_last_resumed.weights", full_weights(model))
    write_json(OUT, "zero3_last_resumed", {"started_at": started[0], "global_step": t.global_step,
                                           "warnings": [str(w.message) for w in caught if "skipping" in str(w.message)]})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    parts = {"resume": resume_zero3, "from_ddp": resume_zero3_from_ddp, "convert": convert_and_resume_ddp,
             "last_after_damage": resume_last_after_damage}
    for label in sys.argv[2:] or ["ddp", "zero1", "zero2", "zero3", "resume", "from_ddp", "convert",
                                  "last_after_damage"]:
        parts.get(label, lambda: run(label))()
