"""This rank's fp32 master weights of one flat layout, and the optimizer parameters over them.

Storage is one master tensor per bucket (a view of the 16-bit shard when that is fp32 already, else an fp32
copy), so the write-back after a step is one copy per bucket. The optimizer, however, steps one *piece* per
parameter fragment: a leaf ``nn.Parameter`` viewing that fragment's elements of the bucket master. So each
parameter has its own optimizer state (Adam's per-tensor ``step`` included), and a parameter that got no
gradient in a step is given ``grad=None``, which every torch optimizer skips: weights, moments and weight
decay stay as they are, exactly as under DDP (docs/core-api.md, "No gradient, no step").
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .fragments import Fragment
from .layout import FlatLayout, Range


class MasterShards:
    """fp32 masters of one layout on one rank: bucket storage, and one optimizer parameter per fragment."""

    def __init__(self, layout: FlatLayout, rank: int, param_shards: Sequence[torch.Tensor],
                 master_dtype: torch.dtype = torch.float32) -> None:
        self.buckets = [s.detach() if s.dtype == master_dtype else s.detach().to(master_dtype) for s in param_shards]
        self.pieces = list(layout.fragments(rank))
        self.params = [nn.Parameter(self.buckets[f.bucket][f.shard_range.as_slice()], requires_grad=True)
                       for f in self.pieces]

    def attach_grads(self, grad_shards: Sequence[torch.Tensor], used: Sequence[bool], inv_scale: float,
                     clip_coef: Optional[torch.Tensor]) -> None:
        """Give each piece its fp32 gradient (unscaled, clipped), or None when its parameter ``used[i]`` is
        False: no rank produced a gradient for it, so the optimizer must leave it alone."""
        grads = []
        for bucket, grad in zip(self.buckets, grad_shards):
            if grad.dtype != bucket.dtype:
                grad = grad.to(bucket.dtype)
            if inv_scale != 1.0:
                grad.mul_(inv_scale)
            if clip_coef is not None:
                grad.mul_(clip_coef)
            grads.append(grad)
        for master, piece in zip(self.params, self.pieces):
            master.grad = grads[piece.bucket][piece.shard_range.as_slice()] if used[piece.param_index] else None

    def clear_grads(self) -> None:
        for master in self.params:
            master.grad = None

    def holds_values(self) -> bool:
        """Whether some master is in memory (NVMe-offloaded ones are swapped out between steps)."""
        return True

    def write_back(self, param_shards: Sequence[torch.Tensor]) -> None:
        """Copy updated values into the 16-bit shards (nothing to do where the master is the shard itself)."""
        for shard, master in zip(param_shards, self.buckets):
            if shard.data_ptr() != master.data_ptr():
                shard.copy_(master)

    def read_from(self, param_shards: Sequence[torch.Tensor]) -> None:
        """The shards were changed in place (GatheredParameters with a modifier): take their values."""
        for shard, master in zip(param_shards, self.buckets):
            if shard.data_ptr() != master.data_ptr():
                master.copy_(shard)

    def fragments(self, names, shapes, dtype: torch.dtype, grad_shards: Sequence[torch.Tensor]) -> list[Fragment]:
        """One Fragment per piece; ``master`` is the piece the optimizer steps (its state has its shape)."""
        fragments = []
        for master, piece in zip(self.params, self.pieces):
            local = piece.shard_range
            fragments.append(Fragment(
                name=names[piece.param_index], shape=shapes[piece.param_index], dtype=dtype,
                param_range=piece.param_range, master=master, grad_shard=grad_shards[piece.bucket][local.as_slice()],
                local=Range(0, local.size)))
        return fragments
