"""Activation checkpoints through the engine: DeepSpeed's ``deepspeed.checkpointing`` functions, honouring the
``activation_checkpointing`` config block (docs/stage3.md, "Activation checkpoints").

    from zero_core.checkpointing import checkpoint
    h = checkpoint(block, h)

``zero_core.setup`` configures them from its config; ``configure`` does so directly (and takes the model-parallel
group ``partition_activations`` needs).
"""

from zero_core.checkpointing.function import checkpoint
from zero_core.checkpointing.hf import route_hf_checkpointing
from zero_core.checkpointing.settings import configure, current, reset


def log_profile():
    """With ``activation_checkpointing.profile``: log the timings of the pass so far (rank 0, logger
    ``zero_core.checkpointing``) and return them (a ``Timings``); None when profile is off."""
    profiler = current().profiler
    return profiler.log() if profiler is not None else None


__all__ = ["checkpoint", "configure", "current", "log_profile", "reset", "route_hf_checkpointing"]
