"""``offload_param: {device: nvme}`` at stage 3 (ZeRO-Infinity): parameter shards in a per-rank file.

Units are taken in model order; while their shards add up to at most ``max_in_cpu`` elements they stay in host
memory as with ``device: cpu``, and the rest are written to this rank's file. Such a unit's ``shard`` is an
empty tensor between uses. Its gather (ParamUnit.gather, issued ahead of use by the trace's prefetch) reads the
shard into one of ``buffer_count`` buffers of ``buffer_size`` elements and all-gathers from it; the buffer goes
back to the pool when the gather is done. When every buffer is taken, the oldest gather still holding one is
finished first. Writes to a shard (the optimizer's write-back, GatheredParameters with a modifier, loading a
checkpoint) read it into a buffer, change it there and write it out again (:meth:`ParamSwap.resident`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
import weakref
from collections import OrderedDict
from typing import Iterator

import torch

from zero_core.offload.aio import AioPool, Transfer
from zero_core.offload.nvme_swap import check_nvme_path, remove_swap_file
from zero_core.offload.placement import pinning


class ParamSwap:
    """This rank's parameter swap file, its buffer pool, and the units whose shards live in it."""

    FIELD = "zero_optimization.offload_param"

    def __init__(self, block, aio, rank: int, shards: list[torch.Tensor]) -> None:
        check_nvme_path(block.nvme_path, f"{self.FIELD}.nvme_path", sum(s.numel() * s.element_size() for s in shards))
        largest = max((s.numel() for s in shards), default=0)
        itemsize = max((s.element_size() for s in shards), default=1)
        if block.buffer_count < 1:
            raise ValueError(f"{self.FIELD}.buffer_count is 0, but device 'nvme' reads each shard into one of its "
                             "buffers: set it to at least 1 (DeepSpeed's default is 5)")
        if largest > block.buffer_size:
            raise ValueError(
                f"{self.FIELD}.buffer_size={block.buffer_size} elements is smaller than this rank's largest "
                f"parameter shard ({largest} elements): raise buffer_size to at least {largest}, or make units "
                "smaller (more ranks, or smaller modules)")
        self.pool = AioPool.from_config(aio)
        self.path = os.path.join(block.nvme_path, f"zero_params_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}.swp")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._finalizer = weakref.finalize(self, remove_swap_file, self.fd, self.path, self.pool)
        self.buffer_bytes = min(block.buffer_size, largest) * itemsize  # no bigger than any shard needs
        self.pin = pinning(block.pin_memory)
        self._free = [self._new_buffer() for _ in range(block.buffer_count)]
        self._held: OrderedDict = OrderedDict()  # unit -> buffer, oldest first
        self._offset: dict[int, int] = {}  # id(unit) -> file offset
        self._end = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def _new_buffer(self) -> torch.Tensor:
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def close(self) -> None:
        self._finalizer()

    # -- placing units -------------------------------------------------------------------------------------
    def adopt(self, unit) -> None:
        """Write ``unit``'s shard to the file and drop it from memory."""
        numel = unit.shard.numel()
        nbytes = numel * unit.shard.element_size()
        if nbytes > self.buffer_bytes:  # a unit built after setup (add_param_group, unfreezing)
            raise ValueError(f"{self.FIELD}.buffer_size is too small for the shard of '{unit.module_name}' "
                             f"({numel} elements): raise buffer_size to at least {numel}")
        self._offset[id(unit)] = self._end
        self._end += -(-nbytes // self.pool.block_size) * self.pool.block_size
        self._write(unit, unit.shard).wait()
        unit.swapped_shard = (numel, unit.shard.dtype)
        unit.shard = torch.empty(0, dtype=unit.shard.dtype, device=unit.shard.device)
        unit.swap = self

    def _write(self, unit, tensor: torch.Tensor) -> Transfer:
        transfer = Transfer()
        self.pool.write(transfer, self.fd, tensor, self._offset[id(unit)])
        self.bytes_written += tensor.numel() * tensor.element_size()
        return transfer

    # -- buffers -------------------------------------------------------------------------------------------
    def _acquire(self) -> torch.Tensor:
        while not self._free:
            oldest = next(iter(self._held))
            oldest.wait()  # finishes its gather, which gives its buffer back (release)
            if self._held and next(iter(self._held)) is oldest:
                raise RuntimeError(f"{self.FIELD}: every buffer is in use; raise buffer_count (a bug if 5 or more)")
        return self._free.pop()

    def read(self, unit) -> torch.Tensor:
        """``unit``'s shard, read into a pool buffer that the unit holds until :meth:`release`."""
        buffer = self._acquire()
        numel, dtype = unit.swapped_shard
        shard = buffer[: numel * dtype.itemsize].view(dtype)
        transfer = Transfer()
        self.pool.read(transfer, self.fd, shard, self._offset[id(unit)])
        transfer.wait()
        self.bytes_read += shard.numel() * shard.element_size()
        self._held[unit] = buffer
        return shard

    def release(self, unit) -> None:
        buffer = self._held.pop(unit, None)
        if buffer is not None:
            self._free.append(buffer)

    @contextlib.contextmanager
    def resident(self, unit) -> Iterator[None]:
        """``unit.shard`` is in memory for the duration; what is written to it goes back to the file."""
        empty = unit.shard
        unit.shard = self.read(unit)
        try:
            yield
            self._write(unit, unit.shard).wait()
        finally:
            unit.shard = empty
            self.release(unit)
