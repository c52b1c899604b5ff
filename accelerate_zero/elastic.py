"""Keeping the global batch when ``load_state`` resumes at another world size (``torchrun``/``accelerate launch``
with ``--nnodes MIN:MAX`` after a node is lost or comes back, or any resume on fewer or more processes).

``save_state`` records world size x ``gradient_accumulation_steps`` (micro-batches per optimizer step over all
processes; the micro-batch is the DataLoader's, the same in every attempt). ``load_state`` at another world size
sets ``gradient_accumulation_steps`` so that the product is the same again, and moves ``accelerator.step`` (this
process's micro-batches since the last sync) to the same point; or raises one line saying why it cannot.
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger("accelerate_zero")

KEY = "global_batch"  # zero_state.json's entry: {"world_size": W, "gradient_accumulation_steps": A}


def batch_record(accelerator) -> dict[str, int]:
    return {"world_size": int(accelerator.num_processes),
            "gradient_accumulation_steps": int(accelerator.gradient_accumulation_steps)}


def keep_global_batch(accelerator, saved: Optional[dict]) -> Optional[int]:
    """Re-plan the accumulation for a state saved at another world size; returns the new one, or None when
    nothing changed (the same size, or a state without the record)."""
    world = accelerator.num_processes
    if saved is None or saved["world_size"] == world:
        return None
    saved_steps = saved["gradient_accumulation_steps"]
    micro_batches = saved["world_size"] * saved_steps
    if micro_batches % world:
        raise ValueError(
            f"load_state resumes on {world} processes from a state saved on {saved['world_size']} with "
            f"gradient_accumulation_steps={saved_steps}: its global batch of {micro_batches} micro-batches cannot "
            f"be split over {world} processes; resume on a number of processes that divides {micro_batches}")
    if accelerator.step % saved_steps:
        raise ValueError(
            f"the state was saved in the middle of an accumulation cycle (micro-batch {accelerator.step % saved_steps} "
            f"of {saved_steps}), so it cannot resume on another number of processes; save_state after an "
            "optimizer step (when accelerator.sync_gradients is True)")
    steps = micro_batches // world
    accelerator.step = accelerator.step // saved_steps * steps
    accelerator.gradient_accumulation_steps = steps
    if accelerator.is_main_process:
        logger.info(f"ZeroAccelerator: resumed on {world} processes from a state saved on {saved['world_size']}; "
                    f"gradient_accumulation_steps {saved_steps} -> {steps} keeps the global batch")
    return steps
