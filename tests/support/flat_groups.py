"""One rank's flat parameter group with fp32 masters, and seeded gradients for it: what the offloaded step's
single-process tests (tests/offload) step with and without offload."""

from __future__ import annotations

import torch

from zero_core.layout import compute_layout
from zero_core.replicated.flat_param_group import FlatParamGroup


def flat_group(sizes: list[int], bucket: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> FlatParamGroup:
    """Parameters of ``sizes`` elements (seeded values, ``dtype``) in buckets of ``bucket``, with fp32 masters."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype)) for size in sizes]
    group = FlatParamGroup(params, [f"p{i}" for i in range(len(params))], 0, compute_layout(sizes, 1, bucket),
                           rank=0, full_grads=False)
    group.build_masters(torch.float32)
    return group


def set_grads(group: FlatParamGroup, step: int) -> None:
    """The group's gradient shards, as a reduction would leave them: seeded by ``step``, in their own dtype."""
    generator = torch.Generator().manual_seed(100 + step)
    for shard in group.grad_shards():
        shard.copy_(torch.randn(shard.shape, generator=generator).to(shard.dtype))
