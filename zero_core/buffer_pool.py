"""Constant-size scratch buffers (ZeRO-R "CB"): bucket staging and reduce-scatter outputs.

Every buffer is allocated at the largest size it will be asked for, then reused across buckets and steps, so
scratch memory depends on the bucket size and on how many buckets are in flight, never on the model.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Hands out zeroed scratch tensors of one capacity per dtype and takes them back for reuse."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer of at least ``numel`` elements; slice it, then ``release`` the whole buffer."""
        if numel > self.capacity:
            raise ValueError(f"scratch request of {numel} elements exceeds the pool capacity {self.capacity}")
        free = self._free.get(dtype)
        if free:
            buffer = free.pop()
            buffer[:numel].zero_()
            return buffer
        buffer = torch.zeros(self.capacity, dtype=dtype, device=self.device)
        self._all.append(buffer)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.dtype, []).append(buffer)

    def nbytes(self) -> int:
        """Bytes held by the pool, in use or free."""
        return sum(b.numel() * b.element_size() for b in self._all)
