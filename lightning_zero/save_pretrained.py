"""``save_pretrained`` called on one rank of a ZeRO stage 3 model under Lightning (Trainer or Fabric): the core's
check (zero_core/stage3/save_pretrained_check.py) with the ways to save that work with the strategy."""

from __future__ import annotations

from zero_core import install_save_pretrained_check

ADVICE = (
    "in Lightning, `trainer.strategy.save_16bit_model(dir)` on every rank (the live weights as safetensors "
    "shards; at stage 3 the config needs stage3_gather_16bit_weights_on_model_save: true), or "
    "`trainer.save_checkpoint(path)` on every rank and `python -m lightning_zero.convert` for one file"
)


def install_if_loaded(stage: int) -> None:
    """At stage 3, wrap ``save_pretrained`` of ``PeftModel`` and ``PreTrainedModel`` (if imported by now: the
    model is built) with the check."""
    if stage == 3:
        install_save_pretrained_check("lightning", ADVICE)
