"""Constant-size scratch buffers (ZeRO-R "CB"): bucket staging and reduce-scatter outputs.

Requests are rounded up to a power of two (capped at the largest size the pool serves), so a buffer is at most
twice what was asked, and buffers are reused across buckets and steps: scratch memory depends on the bucket
size and on how many buckets are in flight, never on the model.
"""

from __future__ import annotations

import torch

from zero_core.planning import pool_capacity


class BufferPool:
    """Hands out zeroed scratch tensors in power-of-two size classes and takes them back for reuse."""

    def __init__(self, device: torch.device, largest: int) -> None:
        self.device = device
        self.largest = max(int(largest), 1)
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []

    def acquire(self, numel: int, dtype: torch.dtype, zeroed: bool = True) -> torch.Tensor:
        """A buffer of at least ``numel`` elements, its first ``numel`` zeroed unless ``zeroed=False`` (the caller
        writes every element it uses); slice it, then ``release`` the whole buffer."""
        if numel > self.largest:
            raise ValueError(f"scratch request of {numel} elements exceeds the largest pool size {self.largest}")
        capacity = pool_capacity(numel, self.largest)
        free = self._free.get((dtype, capacity))
        if free:
            buffer = free.pop()
            if zeroed:
                buffer[:numel].zero_()
            return buffer
        buffer = torch.zeros(capacity, dtype=dtype, device=self.device)
        self._all.append(buffer)
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.dtype, buffer.numel()), []).append(buffer)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, in use or free."""
        return list(self._all)

    def nbytes(self) -> int:
        """Bytes held by the pool, in use or free."""
        return sum(b.numel() * b.element_size() for b in self._all)
