"""DeepSpeed's ``aio`` block mapped onto a thread pool doing large positioned reads and writes (no libaio).

- ``thread_count``: worker threads (the GIL is released inside ``os.preadv``/``os.pwritev``);
- ``block_size``: bytes per request, so one tensor is read/written as several requests that run in parallel;
- ``queue_depth``: requests in the pool per thread at once (the rest wait in a backlog; the caller never blocks);
- ``single_submit``: a transfer's requests go one after another (each submitted when the previous is done)
  instead of as one batch;
- ``overlap_events``: let transfers run while the optimizer steps (false: every transfer is waited at once).
The threads start with the first request and stop at :meth:`AioPool.close` (the engine's teardown); a request
after that starts them again.
File offsets are aligned to ``block_size`` by the caller (nvme_swap.py), so requests are large and aligned.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections import deque
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

    def done(self) -> bool:
        """Whether every request has finished (without waiting; :meth:`wait` still re-raises errors)."""
        return all(future.done() for future in self.futures)

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        self.futures = []
        if self._then is not None:
            then, self._then = self._then, None
            then()


class _Request:
    """One positioned read or write of ``view`` (bytes of ``tensor``, kept alive until done) at ``offset``;
    ``chained``: the request submitted once this one is done (``single_submit``)."""

    __slots__ = ("io", "fd", "view", "offset", "tensor", "future", "chained")

    def __init__(self, io, fd: int, view: memoryview, offset: int, tensor: torch.Tensor) -> None:
        self.io, self.fd, self.view, self.offset, self.tensor = io, fd, view, offset, tensor
        self.future: Future = Future()
        self.chained: Optional["_Request"] = None


class AioPool:
    """The thread pool behind every swap of one engine. Submitting never blocks the caller: requests beyond
    ``queue_depth`` × ``thread_count`` wait in a backlog and each finished request submits the next, so a swap
    can read ahead (param_swap.py) while the training thread goes on."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int, single_submit: bool,
                 overlap_events: bool) -> None:
        self.block_size = block_size
        self.single_submit = single_submit
        self.overlap = overlap_events
        self.thread_count = thread_count
        self._executor: Optional[ThreadPoolExecutor] = None  # started by the first request after each close
        self._limit = max(queue_depth, 1) * thread_count
        self._lock = threading.Condition()
        self._backlog: deque[_Request] = deque()
        self._running = 0

    @classmethod
    def from_config(cls, aio) -> "AioPool":
        return cls(aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit, aio.overlap_events)

    def _run(self, request: _Request, pump: bool = True) -> None:
        try:
            request.io(request.fd, request.view, request.offset)
        except BaseException as error:  # noqa: BLE001 - re-raised by Transfer.wait on the training thread
            while request is not None:  # a chained request after a failed one fails too
                request.future.set_exception(error)
                request = request.chained
        else:
            request.view = request.tensor = None  # the caller may drop the tensor now
            request.future.set_result(None)
            if request.chained is not None:
                with self._lock:
                    self._backlog.appendleft(request.chained)
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()
        if pump:
            self._pump()

    def _pump(self) -> None:
        """Submit backlog requests while fewer than ``queue_depth`` × ``thread_count`` are in the pool."""
        while True:
            with self._lock:
                if not self._backlog or self._running >= self._limit:
                    return
                request = self._backlog.popleft()
                self._running += 1
            try:
                self._threads().submit(self._run, request)
            except RuntimeError:  # the interpreter is exiting (no new work for the pool): do it on this thread
                self._run(request, pump=False)

    def _submit(self, transfer: Transfer, io, fd: int, tensor: torch.Tensor, offset: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        requests = [_Request(io, fd, byte_view(tensor, start, min(self.block_size, nbytes - start)), offset + start,
                             tensor) for start in range(0, nbytes, self.block_size)]
        if not requests:
            return
        transfer.futures += [request.future for request in requests]
        if self.single_submit:  # one request of this transfer at a time
            for request, following in zip(requests, requests[1:]):
                request.chained = following
            requests = requests[:1]
        with self._lock:
            self._backlog.extend(requests)
        self._pump()

    def write(self, transfer: Transfer, fd: int, tensor: torch.Tensor, offset: int) -> None:
        self._submit(transfer, _pwrite, fd, tensor, offset)

    def read(self, transfer: Transfer, fd: int, tensor: torch.Tensor, offset: int) -> None:
        self._submit(transfer, _pread, fd, tensor, offset)

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.thread_count, thread_name_prefix="zero-aio")
            return self._executor

    @property
    def running(self) -> bool:
        """Whether the pool's threads are started (they are between the first request and :meth:`close`)."""
        return self._executor is not None

    def close(self) -> None:
        """Finish every request and stop the threads (idempotent); a later request starts them again."""
        with self._lock:  # let the backlog drain: its requests are submitted by the ones running
            self._lock.wait_for(lambda: not self._backlog and self._running == 0)
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
