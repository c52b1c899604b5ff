"""ZeRO-Infinity's optimizer swap: fp32 masters and their per-element optimizer state in one file per rank.

A swapped-out tensor keeps its object (the optimizer's state dict and param_groups still hold it) but its
``.data`` becomes an empty tensor; swapping in points it at a host buffer again and reads the file into it. Freed
buffers are kept for the next tiles (up to ``pool_bytes``) while anything is read in: reading into memory already
touched runs several times faster than into fresh pages. Once nothing is read in any more (the end of a step, a
checkpoint's stream, a debugging read) the kept buffers go back to the OS, so between steps the swap holds no
memory and the peak of forward and backward does not pay for the step's tiles. Buffers of 1 MiB or more are
mapped from the OS each on its own (:func:`host_buffer`), so that freeing one returns its memory at once whatever
the C allocator's thresholds. Each (tensor, state key) has a fixed region of the file, aligned to the aio
``block_size``.
"""

from __future__ import annotations

import mmap
import os
import shutil
import uuid
import weakref
from typing import Callable, Iterable, Optional

import torch

from zero_core.offload.aio import AioPool, Transfer

_MASTER = "__master__"

# With device 'nvme' the step reads, steps and writes out tiles of at most this many elements, whatever
# sub_group_size says: the step holds about four tiles at once (the one stepping, the next being read, the last
# being written, one freed for the next read), 12 bytes per element with Adam, so a tile of sub_group_size's
# default (1e9 elements) brought the whole offloaded state back into memory for the step. A tile of 12 MiB still
# keeps the aio queue (block_size x queue_depth x thread_count, 8 MiB by default) full: a 25M-parameter step took
# 0.12 s in one tile and in 1M-element tiles alike (benchmarks/offload_peak.py).
NVME_TILE_NUMEL = 1 << 20

# Buffers this big or bigger are mapped on their own: glibc's malloc serves a large block from its heap once its
# (dynamic) mmap threshold has grown past it, and a freed block in the middle of the heap stays resident, so a
# swap that frees tiles of a few MiB kept most of them in the process's memory.
MAPPED_BYTES = 1 << 20
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)  # POSIX; elsewhere torch's allocator serves every buffer
_MAP_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | (_ANONYMOUS or 0) | getattr(mmap, "MAP_POPULATE", 0)



def split_into_tiles(items: list, numel_of: Callable[[object], int], limit: int) -> list[list]:
    """``items`` in order, in tiles of at most ``limit`` elements (an item larger than that is a tile alone)."""
    tiles, tile, size = [], [], 0
    for item in items:
        numel = numel_of(item)
        if tile and size + numel > limit:
            tiles.append(tile)
            tile, size = [], 0
        tile.append(item)
        size += numel
    return tiles + [tile] if tile else tiles


def host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory as a flat uint8 tensor. From ``MAPPED_BYTES`` up, an anonymous mapping of its own
    (page-aligned; its pages faulted in at once, MAP_POPULATE: reading 64 MiB into fresh pages took 131 ms one fault
    at a time, 70 ms so, 9 ms into pages already touched), unmapped when the last tensor on it is freed."""
    if nbytes < MAPPED_BYTES or _ANONYMOUS is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=_MAP_FLAGS), dtype=torch.uint8)


def check_nvme_path(path: Optional[str], field: str, need_bytes: int) -> None:
    """Fail before training when the swap directory cannot hold the swap file."""
    if not path:
        raise ValueError(f"{field} is required when device is 'nvme': set it to a directory on a fast local disk")
    if not os.path.isdir(path):
        raise ValueError(f"{field}={path!r} is not an existing directory: create it (on the NVMe drive) or fix "
                         "the path")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{field}={path!r} is not writable by this process: pick a directory you can write to")
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ValueError(f"{field}={path!r} has {free / 2**30:.2f} GiB free but this rank's swap file needs about "
                         f"{need_bytes / 2**30:.2f} GiB: free space or use "
                         "another directory")


def unlink_name(path: str) -> None:
    """Remove a swap file's name from its directory (a no-op when it is gone already). The open descriptor keeps
    the file's blocks readable and writable until it is closed, which frees them."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_swap_file(fd: int, path: str, pool: AioPool) -> None:
    """Stop the pool, close and delete a swap file (a finaliser: also at exit or when its owner is collected)."""
    pool.close()
    os.close(fd)
    unlink_name(path)


class NvmeSwapper:
    """Swap groups of tensors in and out of this rank's file through an :class:`AioPool`."""

    def __init__(self, directory: str, rank: int, pool: AioPool, pool_bytes: int = 0) -> None:
        self.path = os.path.join(directory, f"zero_offload_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}.swp")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.pool = pool
        self._regions: dict[tuple[int, str], int] = {}  # (id(master), key) -> file offset
        self._shapes: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}
        self._free: dict[int, list[torch.Tensor]] = {}  # nbytes -> freed flat uint8 buffers
        self._free_bytes = 0
        self.pool_bytes = pool_bytes
        self._end = 0
        self.bytes_written = 0
        self.bytes_read = 0
        # Regions read in and not released yet (bytes): what this swapper holds in memory of the file's contents,
        # now and at most since the last reset (tests and benchmarks: checkpoints stream tile by tile).
        self._read_in: dict[tuple[int, str], int] = {}
        self._slice_bytes = 0  # of slices read in or made (read_slice, new_slice) and not written out yet
        self.read_in_bytes = 0
        self.peak_read_in_bytes = 0
        # Removed when the engine is collected or the interpreter exits, whichever comes first.
        self._finalizer = weakref.finalize(self, remove_swap_file, self.fd, self.path, pool)

    def close(self) -> None:
        """Delete the file and free its disk space now (nothing swapped out can be read back afterwards)."""
        self._finalizer()

    def teardown(self) -> None:
        """Teardown: finish every transfer, stop the pool's threads and remove the file's name from the directory.
        The file stays open, so the engine can still read and write what it swapped out (the threads start again
        on demand); its blocks are freed by :meth:`close`, when the engine is collected, or at exit."""
        if self._finalizer.alive:
            self.pool.close()
            unlink_name(self.path)

    def _offset(self, master: torch.Tensor, key: str, nbytes: int) -> int:
        region = (id(master), key)
        if region not in self._regions:
            align = self.pool.block_size
            self._regions[region] = self._end
            self._end += -(-nbytes // align) * align
        return self._regions[region]

    def region(self, owner: object, key: str, nbytes: int) -> int:
        """The file offset of (``owner``, ``key``)'s region of ``nbytes``, made on first use: for what is swapped
        without a master of its own (gradients, nvme_grads.py)."""
        return self._offset(owner, key, nbytes)

    def swap_out(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> Transfer:
        """Write each (master, key, tensor) to its region; the memory is released when the transfer is waited."""
        tensors = []
        transfer = Transfer(then=lambda: [self._release(t) for t in tensors])
        for master, key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0:
                continue  # empty shard, or already out
            self._shapes[(id(master), key)] = (tensor.shape, tensor.dtype)
            self.pool.write(transfer, self.fd, tensor, self._offset(master, key, nbytes))
            tensors.append((master, key, tensor))
            self.bytes_written += nbytes
        return transfer

    def drop(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> None:
        """Release tensors read in by :meth:`swap_in` and not changed since, without writing them (the file holds
        their values): a checkpoint save that only reads them."""
        for item in items:
            if item[2].numel():
                self._release(item)

    def shape_of(self, master: torch.Tensor, key: str) -> Optional[tuple[torch.Size, torch.dtype]]:
        """The (shape, dtype) that (``master``, ``key``) has in memory, once written to the file; else None."""
        return self._shapes.get((id(master), key))

    def _release(self, item: tuple[torch.Tensor, str, torch.Tensor]) -> None:
        master, key, tensor = item
        self.read_in_bytes -= self._read_in.pop((id(master), key), 0)
        old = tensor.data
        tensor.data = torch.empty(0, dtype=tensor.dtype)
        self._recycle(old)

    def _holding(self) -> bool:
        return bool(self._read_in) or self._slice_bytes > 0

    def _recycle(self, old: torch.Tensor) -> None:
        """Keep a freed buffer for the next read while anything is read in; once nothing is, give them all back."""
        nbytes = old.numel() * old.element_size()
        whole = old.untyped_storage().nbytes() == nbytes
        if self._holding() and whole and self._free_bytes + nbytes <= self.pool_bytes:
            self._free.setdefault(nbytes, []).append(old.reshape(-1).view(torch.uint8))
            self._free_bytes += nbytes
        elif not self._holding():
            self.trim()

    def trim(self) -> None:
        """Give the kept buffers back (done by itself once nothing is read in)."""
        self._free.clear()
        self._free_bytes = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            self._free_bytes -= nbytes
            return free.pop()
        return host_buffer(nbytes)

    def read_next(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> Transfer:
        """:meth:`swap_in` of the next tile, left running while this one steps (waited at once when
        ``aio.overlap_events`` is false)."""
        transfer = self.swap_in(items)
        if not self.pool.overlap:
            transfer.wait()
        return transfer

    def write_after(self, previous: Optional[Transfer], items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]
                    ) -> Transfer:
        """:meth:`swap_out` of a stepped tile once the ``previous`` tile's write is done (one write in flight),
        left running while the next tile steps (waited at once when ``aio.overlap_events`` is false)."""
        if previous is not None:
            previous.wait()
        transfer = self.swap_out(items)
        if not self.pool.overlap:
            transfer.wait()
        return transfer

    def swap_in(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> Transfer:
        """Grow each tensor's storage back and read its region into it."""
        transfer = Transfer()
        for master, key, tensor in items:
            region = (id(master), key)
            if tensor.numel() or region not in self._shapes:
                continue  # resident, or never written (an empty shard)
            shape, dtype = self._shapes[region]
            nbytes = shape.numel() * dtype.itemsize
            tensor.data = self._buffer(nbytes).view(dtype).view(shape)
            self.pool.read(transfer, self.fd, tensor, self._regions[region])
            self.bytes_read += nbytes
            self._read_in[region] = nbytes
            self.read_in_bytes += nbytes
        self.peak_read_in_bytes = max(self.peak_read_in_bytes, self.read_in_bytes)
        return transfer

    # -- slices of a region: a piece bigger than a tile steps slice by slice (nvme_slices.py) -------------------
    def claim(self, master: torch.Tensor, key: str, shape: torch.Size, dtype: torch.dtype) -> None:
        """A region of the file for (``master``, ``key``), a tensor of ``shape`` and ``dtype`` that is swapped out
        without having been in memory: the caller writes all of it (:meth:`write_slices`) before it is read."""
        self._shapes[(id(master), key)] = (shape, dtype)
        self._offset(master, key, shape.numel() * dtype.itemsize)

    def read_slice(self, transfer: Transfer, master: torch.Tensor, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of (``master``, ``key``)'s region, read into a flat buffer as part of
        ``transfer``; held until :meth:`write_slices` has written it out (or :meth:`release_slice` gave it back)."""
        _, dtype = self._shapes[(id(master), key)]
        buffer = self._slice_buffer(dtype, end - start)
        self.pool.read(transfer, self.fd, buffer, self._regions[(id(master), key)] + start * dtype.itemsize)
        self.bytes_read += buffer.numel() * dtype.itemsize
        return buffer

    def new_slice(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat buffer (uninitialised) held as a slice read in, for :meth:`write_slices` to write."""
        return self._slice_buffer(dtype, numel)

    def _slice_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buffer = self._buffer(nbytes).view(dtype)
        self._slice_bytes += nbytes
        self.read_in_bytes += nbytes
        self.peak_read_in_bytes = max(self.peak_read_in_bytes, self.read_in_bytes)
        return buffer

    def release_slice(self, buffer: torch.Tensor) -> None:
        """Give back a slice buffer (read_slice, new_slice) without writing it: the file holds its values."""
        nbytes = buffer.numel() * buffer.element_size()
        self._slice_bytes -= nbytes
        self.read_in_bytes -= nbytes
        self._recycle(buffer)

    def write_slices(self, master: torch.Tensor, start: int, items: list[tuple[str, torch.Tensor]]) -> Transfer:
        """Write each (key, slice buffer) at element ``start`` of (``master``, key)'s region; the buffers are freed
        when the transfer is waited (waited at once when ``aio.overlap_events`` is false)."""

        transfer = Transfer(then=lambda: [self.release_slice(tensor) for _, tensor in items])
        for key, tensor in items:
            offset = self._regions[(id(master), key)] + start * tensor.element_size()
            self.pool.write(transfer, self.fd, tensor, offset)
            self.bytes_written += tensor.numel() * tensor.element_size()
        if not self.pool.overlap:
            transfer.wait()
        return transfer

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_size

