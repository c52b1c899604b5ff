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
            if storage.data_ptr() in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def model_state_bytes(module, inner_optimizer, groups, pool) -> dict[str, int]:
    """Parameters, gradients, fp32 master copies, optimizer state and buffers (module buffers and scratch).

    Counted in that order, so an fp32 master that is a view of the parameters counts as parameters only.
    """
    counter = _StorageCounter()
    params = counter.nbytes(module.parameters())
    grads = counter.nbytes([s for g in groups for s in g.grad_shards()])
    grads += counter.nbytes([g.flat_grad for g in groups if g.flat_grad is not None])
    grads += counter.nbytes([p.grad for p in module.parameters() if p.grad is not None])
    master = counter.nbytes([m for g in groups for m in g.masters])
    optimizer_state = counter.nbytes(_state_tensors(inner_optimizer))
    buffers = counter.nbytes(module.buffers()) + pool.nbytes()
    return {
        "params": params,
        "grads": grads,
        "fp32_master": master,
        "optimizer_state": optimizer_state,
        "buffers": buffers,
    }
