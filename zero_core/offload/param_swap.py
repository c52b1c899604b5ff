"""``offload_param: {device: nvme}`` at stage 3 (ZeRO-Infinity): parameter shards in a per-rank file.

Units are taken in model order; while their shards add up to at most ``max_in_cpu`` elements they stay in host
memory as with ``device: cpu``, and the rest are written to this rank's file. Such a unit's ``shard`` is an
empty tensor between uses. Its gather (ParamUnit.gather, issued ahead of use by the trace's prefetch)
all-gathers from one of ``buffer_count`` buffers of ``buffer_size`` elements into which the shard was read; the
buffer goes back to the pool when the gather is done. The reads run ahead on the aio threads: at each gather,
stage 3's prefetch calls :meth:`ParamSwap.look_ahead` with the units it gathers and the trace position, and the
swap reads those units' shards, then the next ones along the trace, into free buffers, and again whenever a
buffer comes back; the gather waits only for its own read. Writes to a shard (the optimizer's write-back,
GatheredParameters with a modifier, loading a checkpoint) read it into a buffer, change it there and write it
out again (:meth:`ParamSwap.resident`); a read submitted before such a write is not used. The write runs on the
aio threads while training goes on (the next unit's write-back, the next forward): its buffer stays with it
until it is done, and the next read of that shard waits for it and takes the buffer, values and all, without
reading the file. docs/offload.md.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import weakref
from collections import OrderedDict, defaultdict
from typing import Callable, Iterator, Optional

import torch

from zero_core.offload.aio import AioPool, Transfer
from zero_core.offload.nvme_swap import check_nvme_path, remove_swap_file, unlink_name
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
        self.buffer_count = block.buffer_count
        self._free = [self._new_buffer() for _ in range(block.buffer_count)]
        self._held: OrderedDict = OrderedDict()  # unit -> buffer, oldest first
        self._ahead: OrderedDict = OrderedDict()  # unit -> (buffer, read, _version and _looks at submit), need order
        self._writing: OrderedDict = OrderedDict()  # unit -> (buffer, write) after a change, in flight, oldest first
        self._version: defaultdict[int, int] = defaultdict(int)  # id(unit) -> writes so far
        self._now: list = []  # look_ahead's window: the units needed now, then the trace from a scan index
        self._window: Optional[tuple] = None  # (trace order, next index to scan, direction, units_for)
        self._served: set = set()  # units read since the last look_ahead (their gather is being issued)
        self._refilling = False
        self._offset: dict[int, int] = {}  # id(unit) -> file offset
        self._end = 0
        self.bytes_read = 0
        self.bytes_written = 0
        # Counters (tests, benchmarks). Reads used by a gather or write: submitted at an earlier look_ahead
        # (reads_ahead: they overlapped what ran since), submitted with this gather's batch (reads_with_gather:
        # they overlap each other), or submitted and waited on the spot (reads_waited). Reads ahead issued,
        # dropped to free a buffer, and found stale (the shard was written after they were submitted).
        self.reads_ahead = self.reads_with_gather = self.reads_waited = 0
        self.reads_issued_ahead = self.reads_dropped = self.reads_stale = 0
        self._looks = 0  # look_ahead calls so far
        self.read_wait_s = 0.0  # seconds the training thread waited for reads (benchmarks)
        # Writes after a change (resident): submitted and left running, still running when the training thread
        # went on, waited because a buffer or the shard was needed, and reads served from a write's buffer.
        self.writes_async = self.writes_in_flight = self.writes_waited = self.reads_from_write = 0
        self.write_wait_s = 0.0  # seconds the training thread waited for such writes

    def _new_buffer(self) -> torch.Tensor:
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def close(self) -> None:
        """Delete the file and free its disk space now (the engine cannot use the swapped units afterwards)."""
        self._finalizer()

    def teardown(self) -> None:
        """Teardown: finish every read and write (reads ahead stay usable), stop the pool's threads and remove the
        file's name from the directory; the open file still serves the engine (e.g. ``test`` after ``fit``) until
        :meth:`close`, the engine's collection, or exit frees it (nvme_swap.NvmeSwapper.teardown)."""
        if self._finalizer.alive:
            self.pool.close()
            unlink_name(self.path)

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
        self._version[id(unit)] += 1  # a read submitted before this write is stale
        transfer = Transfer()
        self.pool.write(transfer, self.fd, tensor, self._offset[id(unit)])
        self.bytes_written += tensor.numel() * tensor.element_size()
        return transfer

    # -- buffers and reads ---------------------------------------------------------------------------------
    # A buffer is free, or holds a read ahead (``_ahead``: submitted, not yet used by a gather), or is held by a
    # unit whose gather or change has it (``_held``, oldest first), or is being written out after a change
    # (``_writing``). The four never exceed ``buffer_count``.
    def _acquire(self) -> torch.Tensor:
        """A free buffer: else the oldest write after a change is waited, else the read furthest ahead gives its
        buffer up (it is read again later), else the oldest gather still holding one is finished."""
        self._refilling = True  # buffers freed here serve this read, not the window
        try:
            self._reap()
            while not self._free:
                if self._writing:
                    self._finish_write(next(iter(self._writing)))
                    continue
                if self._ahead:
                    unit, (buffer, transfer, *_) = self._ahead.popitem()  # the newest: needed last
                    transfer.wait()
                    self.reads_dropped += 1
                    self._free.append(buffer)
                    continue
                if not self._held:
                    raise RuntimeError(f"{self.FIELD}: no parameter buffer is free (buffer_count={self.buffer_count})")
                oldest = next(iter(self._held))
                oldest.wait()  # finishes its gather, which gives its buffer back (release)
                if self._held and next(iter(self._held)) is oldest:
                    raise RuntimeError(
                        f"{self.FIELD}: all {self.buffer_count} buffers are held (the oldest by '{oldest.module_name}',"
                        " whose shard is in use outside a gather): raise buffer_count")
            return self._free.pop()
        finally:
            self._refilling = False

    def _submit_read(self, unit, buffer: torch.Tensor) -> tuple[torch.Tensor, Transfer]:
        numel, dtype = unit.swapped_shard
        shard = buffer[: numel * dtype.itemsize].view(dtype)
        transfer = Transfer()
        self.pool.read(transfer, self.fd, shard, self._offset[id(unit)])
        self.bytes_read += shard.numel() * shard.element_size()
        return shard, transfer

    def read(self, unit) -> torch.Tensor:
        """``unit``'s shard in a pool buffer that the unit holds until :meth:`release`: the buffer of its write
        still in flight (waited now), or the read submitted ahead (waited now), or a new one. A read ahead of a
        shard written since is not used (``_version``)."""
        if unit in self._writing:
            buffer = self._finish_write(unit, keep=True)
            self.reads_from_write += 1
            self._held[unit] = buffer
            self._served.add(unit)
            numel, dtype = unit.swapped_shard
            return buffer[: numel * dtype.itemsize].view(dtype)
        ahead = self._ahead.pop(unit, None)
        if ahead is not None:
            buffer, transfer, version, look = ahead
            self._wait(transfer)
            if version == self._version[id(unit)]:
                if look < self._looks:
                    self.reads_ahead += 1
                else:
                    self.reads_with_gather += 1
                self._held[unit] = buffer
                self._served.add(unit)
                numel, dtype = unit.swapped_shard
                return buffer[: numel * dtype.itemsize].view(dtype)
            self.reads_stale += 1
        else:
            buffer = self._acquire()
        shard, transfer = self._submit_read(unit, buffer)
        self._wait(transfer)
        self.reads_waited += 1
        self._held[unit] = buffer
        self._served.add(unit)
        return shard

    def _wait(self, transfer: Transfer) -> None:
        start = time.perf_counter()
        transfer.wait()
        self.read_wait_s += time.perf_counter() - start

    # -- writes after a change -----------------------------------------------------------------------------
    def _finish_write(self, unit, keep: bool = False) -> Optional[torch.Tensor]:
        """Wait for ``unit``'s write (re-raising its error); its buffer is returned (``keep``) or freed."""
        buffer, transfer = self._writing.pop(unit)
        if not transfer.done():
            self.writes_waited += 1
        start = time.perf_counter()
        transfer.wait()
        self.write_wait_s += time.perf_counter() - start
        if keep:
            return buffer
        self._free.append(buffer)
        return None

    def _reap(self) -> None:
        """Free the buffers of writes that have finished (never waits)."""
        for unit in [u for u, (_, transfer) in self._writing.items() if transfer.done()]:
            self._finish_write(unit)

    def flush(self) -> None:
        """Wait for every write after a change (tests; the file then holds every shard's latest values)."""
        while self._writing:
            self._finish_write(next(iter(self._writing)))

    def release(self, unit) -> None:
        buffer = self._held.pop(unit, None)
        if buffer is not None:
            self._free.append(buffer)
            if not self._refilling:
                self._refill()

    # -- reading ahead along the trace ---------------------------------------------------------------------
    def look_ahead(self, now: list, order: Optional[list], position: Optional[int], backward: bool,
                   units_for: Callable) -> None:
        """The units a gather needs ``now``, then those of the modules after ``position`` in the trace's
        ``order`` (before it, in ``backward``): submit their reads while buffers are free, and again whenever a
        buffer comes back, so the disk reads the next units while this one computes. Called by stage 3's
        prefetch (runtime.py ``_fetch``). With ``aio.overlap_events`` false nothing is read ahead."""
        if not self.pool.overlap:
            return
        self._now, self._served = list(now), set()
        self._looks += 1
        if order is None or position is None:
            self._window = None
        else:
            step = -1 if backward else 1
            start = position + step
            if self._window is not None:  # the same pass goes on: resume where the last scan stopped
                w_order, index, w_step, _ = self._window
                if w_order is order and w_step == step and (index - start) * step > 0:
                    start = index
            self._window = (order, start, step, units_for)
        self._refill()

    def _wanted(self, unit) -> bool:
        return (unit.swap is self and unit.state.value == "sharded" and unit not in self._ahead
                and unit not in self._held and unit not in self._served and unit not in self._writing)

    def _next_wanted(self):
        """The next unit along the window whose shard is to be read, or None (the scan index only moves past
        modules with nothing left to read)."""
        for unit in self._now:
            if self._wanted(unit):
                return unit
        if self._window is None:
            return None
        order, index, step, units_for = self._window
        while 0 <= index < len(order):
            for unit in units_for(order[index]):
                if self._wanted(unit):
                    self._window = (order, index, step, units_for)
                    return unit
            index += step
        self._window = (order, index, step, units_for)
        return None

    def _refill(self) -> None:
        self._reap()
        while self._free:
            unit = self._next_wanted()
            if unit is None:
                return
            buffer = self._free.pop()
            _, transfer = self._submit_read(unit, buffer)
            self._ahead[unit] = (buffer, transfer, self._version[id(unit)], self._looks)
            self.reads_issued_ahead += 1

    def reading_ahead(self) -> list:
        """Units whose read is submitted and not yet used by a gather (tests count these)."""
        return list(self._ahead)

    @contextlib.contextmanager
    def resident(self, unit) -> Iterator[None]:
        """``unit.shard`` is in memory for the duration; what is written to it then goes back to the file on
        the aio threads, its buffer held until the write is done (with ``aio.overlap_events`` false: waited
        here). Double-buffered: the next unit's read and change overlap this write."""
        empty = unit.shard
        unit.shard = self.read(unit)
        try:
            yield
        except BaseException:
            unit.shard = empty
            self.release(unit)
            raise
        shard, unit.shard = unit.shard, empty
        self._writing[unit] = (self._held.pop(unit), self._write(unit, shard))
        self.writes_async += 1
        if not self.pool.overlap:
            self._finish_write(unit)
        elif not self._writing[unit][1].done():
            self.writes_in_flight += 1
