"""Bytes held on this rank, by class of model state, counted once per storage."""

from __future__ import annotations

from typing import Iterable

import torch


class _StorageCounter:
    """Adds up tensor storages, each storage once however many views point into it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def nbytes(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    yield value


def _master_tensors(parts) -> Iterable[torch.Tensor]:
    """Each part's fp32 master storage: its bucket tensors, allocated whole even where this rank's shard of a
    bucket is all padding (no piece views it), and its pieces (tensors of their own with NVMe offload)."""
    for part in parts:
        masters = getattr(part, "master_shards", None)
        if masters is not None:
            yield from masters.buckets
        yield from part.masters


def model_state_bytes(module, inner_optimizers, runtime) -> dict[str, int]:
    """Parameters, gradients, fp32 master copies, optimizer state and buffers (module buffers and scratch).

    Counted in that order, so an fp32 master that is a view of the parameters counts as parameters only.
    """
    counter = _StorageCounter()
    params = counter.nbytes(module.parameters()) + counter.nbytes(runtime.param_shards())
    grads = counter.nbytes(runtime.grad_tensors())
    scratch = counter.nbytes(runtime.scratch_tensors())  # before .grad: stage 2 lends a pool buffer to some
    grads += counter.nbytes([p.grad for p in module.parameters() if p.grad is not None])
    master = counter.nbytes(_master_tensors(runtime.parts))
    optimizer_state = counter.nbytes(_state_tensors(inner_optimizers))
    buffers = counter.nbytes(module.buffers()) + scratch
    return {
        "params": params,
        "grads": grads,
        "fp32_master": master,
        "optimizer_state": optimizer_state,
        "buffers": buffers,
    }
