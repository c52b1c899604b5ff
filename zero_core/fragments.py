"""What one rank holds of each parameter's fp32 training state, described the same way for every stage.

Checkpoints, the ``safe_get_*`` / ``safe_set_*`` debugging API and consolidation read and write model state
only through these fragments, so they work unchanged whatever the stage and the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.layout import Range


@dataclass(frozen=True)
class Fragment:
    """Elements ``param_range`` of the flattened parameter ``name`` live on this rank.

    They sit at ``local`` inside ``master`` (the fp32 tensor the optimizer steps, whose per-element optimizer
    state has the same shape) and inside ``grad_shard`` (the reduced gradient, in the gradient dtype and scaled
    like the loss).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype  # the model parameter's dtype
    param_range: Range
    master: torch.Tensor
    grad_shard: torch.Tensor
    local: Range

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return self.shape.numel()

    def master_values(self) -> torch.Tensor:
        return self.master.detach()[self.local.as_slice()]

    def grad_values(self) -> torch.Tensor:
        return self.grad_shard[self.local.as_slice()]
