"""Keeping the global batch when a state is resumed at another world size (``torchrun``/``accelerate launch``
with ``--nnodes MIN:MAX`` after a node is lost or comes back, or any resume on fewer or more processes).

Every save records world size x gradient accumulation (micro-batches per optimizer step over all processes; the
micro-batch is the DataLoader's, the same in every attempt). A resume at another world size sets the
accumulation so that the product is the same again, or raises one line saying why it cannot:

- ``ZeroAccelerator.load_state`` sets ``accelerator.gradient_accumulation_steps`` and moves ``accelerator.step``
  (this process's micro-batches since the last sync) to the same point;
- the Hugging Face ``Trainer`` (hf_trainer.py) accumulates by its own ``TrainingArguments`` (its Accelerator's is
  always 1), so its checkpoints record ``args.gradient_accumulation_steps`` and ``train(resume_from_checkpoint=...)``
  sets that before the training loop plans its epochs, so the batches it skips and the steps it takes are
  counted in the re-planned micro-batches.
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger("accelerate_zero")

KEY = "global_batch"  # zero_state.json's entry: {"world_size": W, "gradient_accumulation_steps": A}


def batch_record(world_size: int, gradient_accumulation_steps: int) -> dict[str, int]:
    return {"world_size": int(world_size), "gradient_accumulation_steps": int(gradient_accumulation_steps)}


def replanned_accumulation(saved: Optional[dict], world: int, resumer: str) -> Optional[int]:
    """The accumulation that keeps the saved run's micro-batches per optimizer step on ``world`` processes; None
    at the saved size (a deliberate change of the accumulation there stays the user's) or without a record.
    ``resumer`` names what resumes, for the error."""
    if saved is None or saved["world_size"] == world:
        return None
    saved_steps = saved["gradient_accumulation_steps"]
    micro_batches = saved["world_size"] * saved_steps
    if micro_batches % world:
        raise ValueError(
            f"{resumer} resumes on {world} processes from a state saved on {saved['world_size']} with "
            f"gradient_accumulation_steps={saved_steps}: its global batch of {micro_batches} micro-batches cannot "
            f"be split over {world} processes; resume on a number of processes that divides {micro_batches}")
    return micro_batches // world


def keep_global_batch(accelerator, saved: Optional[dict]) -> Optional[int]:
    """Re-plan the accumulation for a state saved at another world size; returns the new one, or None when
    nothing changed (the same size, or a state without the record)."""
    steps = replanned_accumulation(saved, accelerator.num_processes, "load_state")
    if steps is None:
        return None
    saved_steps = saved["gradient_accumulation_steps"]
    if accelerator.step % saved_steps:
        raise ValueError(
            f"the state was saved in the middle of an accumulation cycle (micro-batch {accelerator.step % saved_steps} "
            f"of {saved_steps}), so it cannot resume on another number of processes; save_state after an "
            "optimizer step (when accelerator.sync_gradients is True)")
    accelerator.step = accelerator.step // saved_steps * steps
    accelerator.gradient_accumulation_steps = steps
    _announce(accelerator, saved, "ZeroAccelerator", "gradient_accumulation_steps", steps)
    return steps


def keep_trainer_global_batch(trainer, saved: Optional[dict]) -> Optional[int]:
    """The same for a Hugging Face ``Trainer``: re-plan ``trainer.args.gradient_accumulation_steps`` before its
    training loop reads it. Its checkpoints are saved at optimizer steps, so no cycle is ever cut."""
    steps = replanned_accumulation(saved, trainer.accelerator.num_processes, "Trainer.train(resume_from_checkpoint)")
    if steps is None:
        return None
    trainer.args.gradient_accumulation_steps = steps
    _announce(trainer.accelerator, saved, "Trainer", "TrainingArguments.gradient_accumulation_steps", steps)
    return steps


def _announce(accelerator, saved: dict, who: str, field: str, steps: int) -> None:
    if accelerator.is_main_process:
        logger.info(f"{who}: resumed on {accelerator.num_processes} processes from a state saved on "
                    f"{saved['world_size']}; {field} {saved['gradient_accumulation_steps']} -> {steps} keeps the "
                    "global batch")
