"""Stage 3's policy: the config values its hooks read, frozen once at setup.

The hooks run for every module of every step; reading these from ``ZeroConfig`` there (properties, aliases)
would cost host time per module and let a config changed after setup take effect halfway. docs/config.md
describes each field under its DeepSpeed name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core.config import ZeroConfig


@dataclass(frozen=True)
class Stage3Policy:
    prefetch_bucket_size: int  # elements gathered ahead of use, per prefetch batch
    max_live_parameters: int  # elements gathered at once, prefetch and reuse included
    max_reuse_distance: int  # elements gathered before a released unit is used again, below which it is kept
    reduce_bucket_size: int  # elements of a coalesced gradient reduce-scatter
    overlap_comm: bool  # reduce-scatters stay in flight while the next bucket fills
    ignore_unused_parameters: bool  # a trainable parameter without a gradient is not an error
    param_dtype: torch.dtype  # the 16-bit (or fp32) training dtype of the gathered parameters

    @classmethod
    def from_config(cls, config: ZeroConfig) -> "Stage3Policy":
        return cls(
            prefetch_bucket_size=int(config.prefetch_bucket_size),
            max_live_parameters=int(config.max_live_parameters),
            max_reuse_distance=int(config.max_reuse_distance),
            reduce_bucket_size=int(config.reduce_bucket_size),
            overlap_comm=bool(config.resolved_overlap_comm),
            ignore_unused_parameters=bool(config.ignore_unused_parameters),
            param_dtype=config.param_dtype,
        )
