"""ZeRO-Infinity's optimizer swap: fp32 masters and their per-element optimizer state in one file per rank.

A swapped-out tensor keeps its object (the optimizer's state dict and param_groups still hold it) but its
storage is resized to zero bytes, as stage 3 does with released parameters; swapping in grows the storage back
and reads the file into it. Each (tensor, state key) has a fixed region of the file, aligned to the aio
``block_size``.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import weakref
from typing import Iterable, Optional

import torch

from .aio import AioPool, Transfer

_MASTER = "__master__"


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
                         f"{need_bytes / 2**30:.2f} GiB (fp32 masters and optimizer state): free space or use "
                         "another directory")


def _remove(fd: int, path: str, pool: AioPool) -> None:
    pool.close()
    os.close(fd)
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class NvmeSwapper:
    """Swap groups of tensors in and out of this rank's file through an :class:`AioPool`."""

    def __init__(self, directory: str, rank: int, pool: AioPool) -> None:
        self.path = os.path.join(directory, f"zero_offload_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}.swp")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.pool = pool
        self._regions: dict[tuple[int, str], int] = {}  # (id(master), key) -> file offset
        self._end = 0
        self.bytes_written = 0
        self.bytes_read = 0
        # Removed when the engine is collected or the interpreter exits, whichever comes first.
        self._finalizer = weakref.finalize(self, _remove, self.fd, self.path, pool)

    def close(self) -> None:
        self._finalizer()

    def _offset(self, master: torch.Tensor, key: str, nbytes: int) -> int:
        region = (id(master), key)
        if region not in self._regions:
            align = self.pool.block_size
            self._regions[region] = self._end
            self._end += -(-nbytes // align) * align
        return self._regions[region]

    def swap_out(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> Transfer:
        """Write each (master, key, tensor) to its region; the storages are freed when the transfer is waited."""
        tensors = []
        transfer = Transfer(then=lambda: [t.untyped_storage().resize_(0) for t in tensors])
        for master, key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0 or tensor.untyped_storage().nbytes() == 0:
                continue  # empty shard, or already out
            if not tensor.untyped_storage().resizable():  # shared with numpy (e.g. by a checkpoint write)
                tensor.data = tensor.detach().clone()
            try:
                self.pool.write(transfer, self.fd, tensor, self._offset(master, key, nbytes))
            except OSError as error:
                raise _clear(error, self.path) from error
            tensors.append(tensor)
            self.bytes_written += nbytes
        return transfer

    def swap_in(self, items: Iterable[tuple[torch.Tensor, str, torch.Tensor]]) -> Transfer:
        """Grow each tensor's storage back and read its region into it."""
        transfer = Transfer()
        for master, key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes == 0 or tensor.untyped_storage().nbytes() != 0:
                continue  # empty, or resident
            if (id(master), key) not in self._regions:
                raise RuntimeError(f"NVMe swap: no saved copy of a master's {key!r}; it was never swapped out")
            tensor.untyped_storage().resize_(nbytes)
            self.pool.read(transfer, self.fd, tensor, self._regions[(id(master), key)])
            self.bytes_read += nbytes
        return transfer

    def file_bytes(self) -> int:
        return os.fstat(self.fd).st_size


def _clear(error: OSError, path: str) -> OSError:
    if error.errno == errno.ENOSPC:
        return OSError(errno.ENOSPC, f"the NVMe swap file {path} filled its disk: free space, or point "
                                     "offload_optimizer.nvme_path at a larger drive")
    return error
