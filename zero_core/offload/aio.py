"""DeepSpeed's ``aio`` block mapped onto a thread pool doing large positioned reads and writes (no libaio).

- ``thread_count``: worker threads (the GIL is released inside ``os.preadv``/``os.pwritev``);
- ``block_size``: bytes per request, so one tensor is read/written as several requests that run in parallel;
- ``queue_depth``: requests of one transfer in flight at once;
- ``single_submit``: submit the requests of a transfer one after another instead of as one batch;
- ``overlap_events``: let transfers run while the optimizer steps (false: every transfer is waited at once).
File offsets are aligned to ``block_size`` by the caller (nvme_swap.py), so requests are large and aligned.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


def byte_view(tensor: torch.Tensor, start: int, length: int) -> memoryview:
    """Writable bytes ``[start, start + length)`` of a contiguous CPU tensor (no numpy needed)."""
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr() + start)).cast("B")


def _pread(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(f"short read from the NVMe swap file at offset {offset}")
        view, offset = view[n:], offset + n


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    try:
        while len(view):
            n = os.pwritev(fd, [view], offset)
            view, offset = view[n:], offset + n
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        message = (f"the NVMe swap file (fd {fd}) filled its disk: free space or point "
                   "offload_optimizer.nvme_path / offload_param.nvme_path at a bigger drive")
        raise OSError(errno.ENOSPC, message) from error


class Transfer:
    """Requests of one or more tensors; :meth:`wait` returns once all are done (re-raising their errors)."""

    def __init__(self, then: Optional[Callable[[], None]] = None) -> None:
        self.futures: list[Future] = []
        self._then = then

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        self.futures = []
        if self._then is not None:
            then, self._then = self._then, None
            then()


class AioPool:
    """The thread pool behind every swap of one engine."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int, single_submit: bool,
                 overlap_events: bool) -> None:
        self.block_size = block_size
        self.single_submit = single_submit
        self.overlap = overlap_events
        self._executor = ThreadPoolExecutor(max_workers=thread_count, thread_name_prefix="zero-aio")
        self._in_flight = threading.BoundedSemaphore(max(queue_depth, 1) * thread_count)

    @classmethod
    def from_config(cls, aio) -> "AioPool":
        return cls(aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit, aio.overlap_events)

    def _run(self, io, fd: int, view: memoryview, offset: int) -> None:
        try:
            io(fd, view, offset)
        finally:
            self._in_flight.release()

    def _submit(self, transfer: Transfer, io, fd: int, tensor: torch.Tensor, offset: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        for start in range(0, nbytes, self.block_size):
            length = min(self.block_size, nbytes - start)
            self._in_flight.acquire()  # queue_depth bounds the requests waiting in the pool
            future = self._executor.submit(self._run, io, fd, byte_view(tensor, start, length), offset + start)
            if self.single_submit:
                future.result()
            transfer.futures.append(future)

    def write(self, transfer: Transfer, fd: int, tensor: torch.Tensor, offset: int) -> None:
        self._submit(transfer, _pwrite, fd, tensor, offset)

    def read(self, transfer: Transfer, fd: int, tensor: torch.Tensor, offset: int) -> None:
        self._submit(transfer, _pread, fd, tensor, offset)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
