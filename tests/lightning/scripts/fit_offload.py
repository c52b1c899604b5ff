"""Fit DDP and the offload strategies on the same data through Lightning's launcher; write what the test compares.

    python tests/lightning/scripts/fit_offload.py OUT_DIR NVME_DIR   (Lightning's launcher starts rank 1)

"zero2_offload" and "zero3_offload" are the registered names; "zero3_compiled" is stage 3 with the compiled host
kernel (``host_kernel: compiled``); "zero3_overlap_backward" is stage 3 with
``overlap_with_backward`` (forced on: CPU processes), fit without clipping beside DDP without clipping
("ddp_unclipped"); ZeroStrategy(offload_optimizer="nvme",
offload_parameters="nvme", nvme_path=...) is ZeRO-Infinity on a directory that exists. "zero3_offload_nvme"
points at Lightning's DeepSpeed default, /local_nvme, which does not exist here: its fit must fail in setup,
before the first step, naming the field. Warnings that mention offload are recorded (there should be none), and
so are the swap files: during fit (a callback), each rank's own right after fit returns (the strategy's
teardown removed them; the weights are read after that, from the files the engine still holds open), and each
rank's own after a fit that raises in training_step (the test also checks that none is left once the processes
exit).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch.distributed as dist
from common import STAGE3, LitGPT, full_weights, loader, message_of, save_rank, trainer, write_json
from lightning.pytorch.callbacks import Callback

import lightning_zero  # noqa: F401  (registers zero2_offload, zero3_offload, zero3_offload_nvme)
from lightning_zero import ZeroStrategy

OUT, NVME = Path(sys.argv[1]), sys.argv[2]
FIT = dict(accumulate_grad_batches=2, gradient_clip_val=0.05, max_epochs=1)
UNCLIPPED = dict(accumulate_grad_batches=2, max_epochs=2)  # overlap_with_backward refuses clipping


def strategy_for(name: str):
    if name == "zero3_overlap_backward":  # each unit's host step started during backward
        return ZeroStrategy(stage=3, config={**STAGE3, "offload_optimizer": {"device": "cpu",
                                                                             "overlap_with_backward": True}})
    if name == "zero3_compiled":  # the host step by the compiled kernel (offload_optimizer.host_kernel)
        return ZeroStrategy(stage=3, config={**STAGE3, "offload_optimizer": {"device": "cpu",
                                                                             "host_kernel": "compiled"}})
    if name == "ddp_unclipped":
        return "ddp"
    if name == "zero3_infinity":
        # max_in_cpu 0: every parameter shard in the file (the default keeps 1e9 elements in host memory)
        config = {**STAGE3, "offload_param": {"max_in_cpu": 0, "buffer_count": 2}}
        return ZeroStrategy(stage=3, config=config, offload_optimizer="nvme", offload_parameters="nvme",
                            nvme_path=NVME)
    return name  # "ddp", "zero2_offload", "zero3_offload", "zero3_offload_nvme"


class ListSwapFiles(Callback):
    """The swap files in NVME after the first training batch (both ranks' files exist by then)."""

    def __init__(self):
        self.seen = None

    def on_train_batch_end(self, trainer, *args):
        if self.seen is None:
            self.seen = sorted(os.listdir(NVME))


class ForceOverlap(Callback):
    """The overlapped step acts only beside an accelerator: forced on here (CPU processes), and counted."""

    def __init__(self):
        self.offload = None

    def on_fit_start(self, trainer, *args):
        self.offload = trainer.strategy._engine._offload
        self.offload.overlap = True


class KeepOffload(Callback):
    """The engine's offload, kept to count the chunks its kernel stepped."""

    def __init__(self):
        self.offload = None

    def on_fit_start(self, trainer, *args):
        self.offload = trainer.strategy._engine._offload


class FailingGPT(LitGPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:  # every rank, at the same batch
            raise RuntimeError("training_step fails on purpose")
        return super().training_step(batch, batch_idx)


def own_swap_files() -> list[list[str]]:
    """Each rank's own swap files in NVME now (a collective; the other rank may not have torn down yet)."""
    mine = sorted(f for f in os.listdir(NVME) if f"_rank{dist.get_rank()}_" in f)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def fit(name: str) -> dict:
    model = LitGPT()
    listing = ListSwapFiles()
    forced = ForceOverlap()
    unclipped = name in ("ddp_unclipped", "zero3_overlap_backward")
    kept = KeepOffload()
    callbacks = [listing] + ([kept] if name == "zero3_compiled" else []) + (
        [forced] if name == "zero3_overlap_backward" else [])
    run = trainer(strategy_for(name), OUT, callbacks=callbacks, **(UNCLIPPED if unclipped else FIT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, loader())
    after_fit = own_swap_files() if dist.is_initialized() else None
    weights = full_weights(model)  # after the teardown: read from the open files
    save_rank(OUT, f"offload_{name}", weights)
    config = getattr(run.strategy, "zero_config", None)
    result = {"global_step": run.global_step,
            "offload_warnings": [str(w.message) for w in caught if "offload" in str(w.message).lower()],
            "devices": None if config is None else [
                block.device if block is not None else "none" for block in (config.offload_optimizer,
                                                                            config.offload_param)]}
    if name == "zero3_infinity":  # a checkpoint of NVMe state (streamed), resumed by a fresh module's fit
        path = OUT / "infinity.ckpt"
        run.save_checkpoint(path)
        fresh = LitGPT()
        trainer(strategy_for(name), OUT, **FIT).fit(fresh, loader(), ckpt_path=str(path))  # nothing left to train
        resumed = full_weights(fresh)
        result["resumed_diff"] = max((resumed[n] - weights[n]).abs().max().item() for n in weights)
    if name == "zero3_compiled":
        result["chunks_stepped"] = kept.offload.chunks_stepped  # the compiled kernel steps in chunks
    if forced.offload is not None:
        result["started_in_backward"] = forced.offload.overlapped.parts_stepped_in_backward
        result["overlapped_steps"] = forced.offload.overlapped.overlapped_steps
    result["nvme_files_during"] = listing.seen
    result["nvme_files_after_fit"] = after_fit  # per rank: its own files once fit returned
    return result


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    results = {name: fit(name) for name in ("ddp", "zero2_offload", "zero3_offload", "zero3_infinity",
                                            "zero3_compiled", "ddp_unclipped", "zero3_overlap_backward")}
    results["zero3_offload_nvme"] = {"error": message_of(lambda: trainer("zero3_offload_nvme", OUT, **FIT).fit(
        LitGPT(), loader()))}
    failing = ListSwapFiles()
    error = message_of(lambda: trainer(strategy_for("zero3_infinity"), OUT, callbacks=[failing], **FIT).fit(
        FailingGPT(), loader()))
    results["zero3_infinity_fails"] = {"error": error, "nvme_files_during": failing.seen,
                                       "nvme_files_after_fit": own_swap_files()}
    write_json(OUT, "offload", results)
