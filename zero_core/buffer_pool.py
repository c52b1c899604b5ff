"""Constant-size scratch buffers (ZeRO-R "CB"): bucket staging and reduce-scatter outputs.

Buffers come in a few fixed sizes (say, the largest bucket and the largest shard), are allocated at that size
and reused across buckets and steps, so scratch memory depends on the bucket size and on how many buckets are
in flight, never on the model.
"""

from __future__ import annotations

from typing import Sequence

import torch


class BufferPool:
    """Hands out zeroed scratch tensors of a few fixed sizes and takes them back for reuse."""

    def __init__(self, device: torch.device, capacities: Sequence[int]) -> None:
        self.device = device
        self.capacities = sorted({max(int(c), 1) for c in capacities})
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer of at least ``numel`` elements; slice it, then ``release`` the whole buffer."""
        capacity = next((c for c in self.capacities if c >= numel), None)
        if capacity is None:
            raise ValueError(f"scratch request of {numel} elements exceeds the largest pool size {self.capacities[-1]}")
        free = self._free.get((dtype, capacity))
        if free:
            buffer = free.pop()
            buffer[:numel].zero_()
            return buffer
        buffer = torch.zeros(capacity, dtype=dtype, device=self.device)
        self._all.append(buffer)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)

    def nbytes(self) -> int:
        """Bytes held by the pool, in use or free."""
        return sum(b.numel() * b.element_size() for b in self._all)
