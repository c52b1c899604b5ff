"""Stage 3 on one rank reduces its gradient bucket in place (zero_core/stage3/coalesced.py).

At world size 1 the reduce-scatter's sum is its input. The bucket is sized for every trainable unit there (the
reduce bucket is capped by what the units hold), so its pool buffer has no spare room, and a separate result
buffer would be as large as the model's 16-bit gradients, allocated at the end of every backward next to the
gradient shards being restored: on one GPU that, not the activations, was the peak that hid what
``cpu_checkpointing`` saves (docs/stage3.md, "Activation checkpoints"). Pinned here: every reduction's result is
the bucket's own memory, through both gloo transports, and training gives the weights of plain PyTorch AdamW."""

from __future__ import annotations

import os

import torch
from torch import nn

import zero_core
from distributed import run_distributed

STEPS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(step))


def _worker(rank: int, world_size: int) -> dict:
    from zero_core import grad_memory
    from zero_core.stage3 import coalesced

    grad_memory.RELEASE_ON_CPU = True  # the shards are freed between steps and restored at the reduction, as on CUDA
    seen = []
    start = coalesced.CoalescedReduce._start

    def spy(self, bucket, comm, async_op):
        start(self, bucket, comm, async_op)
        seen.append(self.result.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr())

    coalesced.CoalescedReduce._start = spy
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        plain(_batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {}
    for transport in ("1", "0"):  # gloo's all-to-all reduce-scatter, and torch's
        os.environ["ZERO_CORE_GLOO_ALL_TO_ALL"] = transport
        seen.clear()
        model = _model()
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        for step in range(STEPS):
            engine.backward(model(_batch(step)).square().mean())
            engine.step()
        with zero_core.GatheredParameters(list(model.parameters())):
            diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
        engine.close()
        out[transport] = {"in_place": list(seen), "diff": diff}
    return out


def test_one_rank_reduces_in_place_and_trains_like_adamw():
    result = run_distributed(_worker, 1, timeout=120)[0]
    for transport, got in result.items():
        assert got["in_place"] and all(got["in_place"]), (transport, got)
        assert got["diff"] < 1e-6, (transport, got)
