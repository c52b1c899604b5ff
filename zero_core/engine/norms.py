"""Gradient norms over every rank's shards: what clipping by the global norm and fp16's overflow check read."""

from __future__ import annotations

import math
from typing import Union

import torch
import torch.distributed as dist

from zero_core.grad_memory import KnownNorm


def shard_norms(shards: list[Union[torch.Tensor, KnownNorm]], norm_type: float,
                device: torch.device) -> torch.Tensor:
    """Each gradient shard's norm, accumulated in fp32 on the device: one foreach kernel per (device, dtype)
    group and no fp32 copy of the shards. Empty shards count as zero. A ``KnownNorm`` (a shard offload moved to
    the host) is its norm already, in the place its shard would have."""
    groups: dict = {}
    for shard in shards:
        if isinstance(shard, KnownNorm) or shard.numel():
            groups.setdefault((shard.device, shard.dtype), []).append(shard)
    norms = [torch.zeros((), device=device)]
    for entries in groups.values():
        tensors = [e for e in entries if not isinstance(e, KnownNorm)]
        computed = iter(torch._foreach_norm(tensors, norm_type, dtype=torch.float32) if tensors else ())
        norms += [(e.value if isinstance(e, KnownNorm) else next(computed)).to(device) for e in entries]
    return torch.stack(norms)


def global_norm(comm, grad_shards: list[Union[torch.Tensor, KnownNorm]], norm_type: float, device: torch.device,
                loss_scale: float) -> torch.Tensor:
    """The norm of the whole (unscaled) gradient, each element counted once: local shard norms, one all-reduce."""
    norms = shard_norms(grad_shards, norm_type, device)
    if math.isinf(norm_type):
        local = norms.max()
        comm.all_reduce(local, op=dist.ReduceOp.MAX)
        return local / loss_scale
    local = norms.pow(norm_type).sum()
    comm.all_reduce(local)
    return local.pow(1.0 / norm_type) / loss_scale
