"""With ``offload_optimizer: nvme``, reduced gradient shards written to the swap file during backward.

ZeRO-Infinity keeps neither the gradients on the accelerator nor all of them in host memory: DeepSpeed writes
each reduced gradient partition out to NVMe (``swap_out_gradients``) and the step reads it back beside its master
and moments. Here each bucket shard the reducer finishes is copied into a host staging buffer (in the gradient's
own dtype; on CUDA from its copy stream, into pinned memory where ``pin_memory`` asks), written to its region of
the rank's swap file on a thread, and its accelerator memory is given back (grad_memory.py). The step then reads
each tile's pieces from the file (host_grads.py). Staging buffers in flight are bounded (a bigger bucket goes in
pieces of the bound): when they would pass it, backward waits for the oldest write, so host memory holds a
constant, not the gradients.

Only where gradient memory is given back (CUDA; tests force it on the CPU): on a CPU-only run the shards are host
memory already and stay where they are.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from zero_core.offload.aio import Transfer
from zero_core.offload.nvme_swap import NvmeSwapper
from zero_core.offload.placement import _copy_stream, copy_between, host_empty, wait_for_copies

_KEY = "grad"  # the swap file's region key of a bucket's gradient: (part, f"grad{bucket}")


class NvmeGrads:
    """Gradient shards of (part, bucket) in ``swapper``'s file, between their reduction and the step."""

    def __init__(self, swapper: NvmeSwapper, pin: bool, staging_bytes: int) -> None:
        self.swapper = swapper
        self.pin = pin
        self.staging_bytes = staging_bytes  # staging in flight, at most (a bigger bucket is written in pieces)
        # (id(part), bucket) -> (part, numel, dtype); the part is held so that its id is not another's meanwhile
        self._in_file: dict[tuple, tuple[object, int, torch.dtype]] = {}
        self._writes: deque[tuple[tuple, Future, int]] = deque()  # (key, its write, staging bytes), oldest first
        self._free: dict[tuple, list[torch.Tensor]] = {}  # (numel, dtype) -> staging buffers for reuse
        self._thread: Optional[ThreadPoolExecutor] = None
        self.buckets_written = 0  # a counter (tests)
        self.pieces_staged = 0  # staging buffers written, a bucket bigger than the bound in several (a counter)
        self.peak_staging_bytes = 0

    def holds(self, part, bucket: int) -> bool:
        """Whether ``bucket``'s latest reduced gradient is in the file (and not on the accelerator)."""
        return (id(part), bucket) in self._in_file

    def put(self, part, bucket: int, grad: torch.Tensor) -> None:
        """Start writing ``grad`` (``bucket``'s reduced shard) to the file: copied into staging buffers now (on
        CUDA, queued on the copy stream), in pieces of at most the staging bound, each written on the thread. The
        caller then gives the shard's memory back."""
        key = (id(part), bucket)
        self._wait(lambda k: k == key)  # an earlier reduction's write of the same region (accumulation)
        nbytes = grad.numel() * grad.element_size()
        base = self.swapper.region(part, f"{_KEY}{bucket}", nbytes)
        flat = grad.view(-1)
        step = max(1, self.staging_bytes // grad.element_size())  # elements per staging buffer
        for start in range(0, flat.numel(), step):
            self._stage(key, flat[start : start + step], base + start * grad.element_size())
        if not self.swapper.pool.overlap:  # aio.overlap_events false: every transfer is waited at once
            self._wait(lambda k: k == key)
        self._in_file[key] = (part, grad.numel(), grad.dtype)
        self.swapper.bytes_written += nbytes
        self.buckets_written += 1

    def _stage(self, key: tuple, piece: torch.Tensor, offset: int) -> None:
        """``piece`` of a gradient copied into a staging buffer and written at ``offset`` on the thread, once the
        staging in flight leaves room for it."""
        nbytes = piece.numel() * piece.element_size()
        while self._writes and self._staging() + nbytes > self.staging_bytes:
            self._wait_oldest()
        staging = self._staging_buffer(piece.numel(), piece.dtype)
        copy_between(staging, piece)
        event = None
        if piece.is_cuda:
            event = torch.cuda.Event()
            event.record(_copy_stream(piece.device, to_device=False))

        def write() -> torch.Tensor:
            if event is not None:
                event.synchronize()  # the copy into the staging buffer has landed
            transfer = Transfer()
            self.swapper.pool.write(transfer, self.swapper.fd, staging, offset)
            transfer.wait()
            return staging

        self._writes.append((key, self._writer().submit(write), nbytes))
        self.pieces_staged += 1
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging())

    def start_read(self, part, bucket: int, start: int, end: int, transfer: Transfer) -> torch.Tensor:
        """Elements ``[start, end)`` of ``bucket``'s gradient read into a new host buffer of its dtype, as part of
        ``transfer`` (the caller waits for it): a read ahead of the step that needs it."""
        key = (id(part), bucket)
        _, numel, dtype = self._in_file[key]
        if not 0 <= start <= end <= numel:
            raise ValueError(f"gradient read [{start}, {end}) of a {numel}-element bucket")
        self._wait(lambda k: k == key)  # its write has landed
        target = torch.empty(end - start, dtype=dtype)
        base = self.swapper.region(part, f"{_KEY}{bucket}", numel * dtype.itemsize)
        self.swapper.pool.read(transfer, self.swapper.fd, target, base + start * dtype.itemsize)
        self.swapper.bytes_read += (end - start) * dtype.itemsize
        return target

    def read(self, part, bucket: int, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of ``bucket``'s gradient into ``out`` (host memory, any float dtype: cast
        on the CPU if it is not the gradient's), now."""
        if out.numel() != end - start:
            raise ValueError(f"gradient read [{start}, {end}) into {out.numel()} elements")
        transfer = Transfer()
        target = self.start_read(part, bucket, start, end, transfer)
        transfer.wait()
        out.copy_(target)

    def copy_in(self, part, buckets: list[int], views: list[torch.Tensor]) -> None:
        """``buckets``' gradients back into ``views`` (their shards, allocated again, on the accelerator or the CPU):
        a reader needs them there (an accumulating reduction, the debugging API). Returns once they are there."""
        for bucket, view in zip(buckets, views):
            host = torch.empty(view.numel(), dtype=view.dtype)
            self.read(part, bucket, 0, view.numel(), host)
            copy_between(view.view(-1), host)
            wait_for_copies([view])
            self._in_file.pop((id(part), bucket), None)

    def forget(self, parts: Optional[list] = None) -> None:
        """``parts``' gradients (None: all) were zeroed: what the file holds of them is not current (another
        optimizer's parts keep theirs). Writes still under way finish."""
        if parts is None:
            self._in_file.clear()
            return
        gone = {id(part) for part in parts}
        self._in_file = {key: value for key, value in self._in_file.items() if key[0] not in gone}

    def finish(self, raise_errors: bool = True) -> None:
        """Every write landed (a failed one raises here, unless not ``raise_errors``: at teardown the gradients
        will not be read); the thread stops."""
        try:
            while self._writes:
                try:
                    self._wait_oldest()
                except OSError:
                    if raise_errors:
                        raise
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None
            self._free.clear()

    def _staging(self) -> int:
        return sum(nbytes for _, _, nbytes in self._writes)

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        return free.pop() if free else host_empty(numel, dtype, self.pin)

    def _wait_oldest(self) -> None:
        key, future, nbytes = self._writes.popleft()
        staging = future.result()
        if not self.pin:
            return  # given back: nothing stays in host memory between steps
        held = sum(b.numel() * b.element_size() for buffers in self._free.values() for b in buffers)
        if held + nbytes <= self.staging_bytes:  # kept for the next bucket of its size: pinning is not free
            self._free.setdefault((staging.numel(), staging.dtype), []).append(staging)

    def _wait(self, which: Callable[[tuple], bool]) -> None:
        """Wait for every write in flight up to the last one ``which`` selects (writes land in order)."""
        last = max((i for i, (key, _, _) in enumerate(self._writes) if which(key)), default=-1)
        for _ in range(last + 1):
            self._wait_oldest()

    def _writer(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-nvme-grads")
        return self._thread
