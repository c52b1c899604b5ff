"""Keeping the global batch when a fit resumes at another world size (``torchrun --nnodes MIN:MAX`` after a node
is lost or comes back, or any resume on fewer or more devices).

Each checkpoint records how many micro-batches one optimizer step took over all ranks (world size x
``accumulate_grad_batches``; the micro-batch size is the DataLoader's, the same in every attempt). A fit that
resumes at another world size sets ``trainer.accumulate_grad_batches`` so that the product is the same again,
and moves the epoch's batch counters to the same point in the epoch (the same optimizer steps taken), so the
accumulation boundaries fall where they did; or raises one line saying why the global batch cannot be kept.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info

KEY = "lightning_zero_global_batch"  # the checkpoint's entry: {"world_size": W, "accumulate_grad_batches": A}
_PROGRESS = ("fit_loop", "epoch_loop.batch_progress", "current")  # where the epoch's batch counters sit


def batch_plan(world_size: int, accumulate_grad_batches: int) -> dict[str, int]:
    return {"world_size": int(world_size), "accumulate_grad_batches": int(accumulate_grad_batches)}


def replanned_accumulation(saved: dict[str, int], world_size: int, accumulation: int) -> int:
    """The accumulation that keeps the saved run's micro-batches per optimizer step on ``world_size`` ranks;
    ``accumulation`` unchanged at the saved size (a deliberate change there stays the user's)."""
    if saved["world_size"] == world_size:
        return accumulation
    micro_batches = saved["world_size"] * saved["accumulate_grad_batches"]
    if micro_batches % world_size:
        raise ValueError(
            f"this fit resumes on {world_size} ranks from a checkpoint saved on {saved['world_size']} with "
            f"accumulate_grad_batches={saved['accumulate_grad_batches']}: its global batch of {micro_batches} "
            f"micro-batches cannot be split over {world_size} ranks; resume on a number of ranks that divides "
            f"{micro_batches}, or pass ZeroStrategy(keep_global_batch=False) to let the global batch change")
    return micro_batches // world_size


def keep_global_batch(trainer: Any, checkpoint: dict, world_size: int) -> Optional[int]:
    """Re-plan ``trainer.accumulate_grad_batches`` for a checkpoint saved at another world size, and move the
    checkpoint's epoch batch counters along (they count this rank's micro-batches). Returns the new
    accumulation, or None when nothing changed (same size, or a checkpoint without the record)."""
    saved = checkpoint.get(KEY)
    if saved is None:
        return None
    new = replanned_accumulation(saved, world_size, trainer.accumulate_grad_batches)
    if new == trainer.accumulate_grad_batches and saved["world_size"] == world_size:
        return None
    if any(isinstance(c, GradientAccumulationScheduler) for c in getattr(trainer, "callbacks", ())):
        raise ValueError(
            f"this fit resumes on {world_size} ranks from a checkpoint saved on {saved['world_size']}, and its "
            "GradientAccumulationScheduler sets accumulate_grad_batches each epoch, so the global batch cannot be "
            "kept by re-planning it; scale the scheduler's values by the world sizes' ratio and pass "
            "ZeroStrategy(keep_global_batch=False)")
    _move_epoch_progress(checkpoint, saved["accumulate_grad_batches"], new)
    rank_zero_info(f"ZeroStrategy: resumed on {world_size} ranks from a checkpoint saved on {saved['world_size']}; "
                   f"accumulate_grad_batches {trainer.accumulate_grad_batches} -> {new} keeps the global batch")
    trainer.accumulate_grad_batches = new
    return new


def _move_epoch_progress(checkpoint: dict, saved_accumulation: int, accumulation: int) -> None:
    """The saved epoch's batch counts, in micro-batches of this rank, become the same optimizer steps' count at
    the new accumulation (Lightning steps when the count is a multiple of ``accumulate_grad_batches``)."""
    progress = checkpoint.get("loops", {})
    for key in _PROGRESS:
        progress = progress.get(key) if isinstance(progress, dict) else None
    if not progress:
        return
    ready = progress.get("ready", 0)
    if ready % saved_accumulation:
        raise ValueError(
            f"the checkpoint was saved in the middle of an accumulation cycle (micro-batch {ready % saved_accumulation} "
            f"of {saved_accumulation}), so it cannot resume at another world size; resume from a checkpoint saved at "
            "an optimizer step (ModelCheckpoint(every_n_train_steps=...) saves there)")
    moved = ready // saved_accumulation * accumulation
    for name, value in progress.items():
        if isinstance(value, int):  # "completed" may trail "ready" by the batch being saved; that gap stays
            progress[name] = moved - (ready - value)
