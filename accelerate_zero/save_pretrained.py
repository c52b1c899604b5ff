"""``save_pretrained`` called on one rank of a ZeRO stage 3 model under Accelerate: the core's check
(zero_core/stage3/save_pretrained_check.py) with the ways to save that work in an Accelerate script."""

from __future__ import annotations

from zero_core import install_save_pretrained_check

ADVICE = (
    "with a Trainer (TRL's too), `trainer.save_model(dir)` on every rank (for a PEFT model it writes the "
    "adapter, fp32); in an Accelerate script, `state_dict = accelerator.get_state_dict(model)` on every rank "
    "(a collective; the whole state on rank 0), then on the main process "
    "`accelerator.unwrap_model(model).save_pretrained(dir, state_dict=state_dict)`"
)


def install_if_loaded() -> None:
    """Wrap ``save_pretrained`` of ``PeftModel`` and ``PreTrainedModel`` (if imported) with the check."""
    install_save_pretrained_check("accelerate", ADVICE)
