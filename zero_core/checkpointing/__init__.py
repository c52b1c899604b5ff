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

__all__ = ["checkpoint", "configure", "current", "reset", "route_hf_checkpointing"]
