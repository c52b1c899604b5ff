"""A byte range of a file as a tensor that shares the page cache: a private (copy-on-write) mapping of just the
pages that hold it.

One mapping of a whole file would serve every range, but when a page of it is touched the kernel may map the
whole page-cache folio around it (up to 2 MiB on ext4 with large folios), pages of other ranks' elements
included, and they count in the rank's resident memory. A mapping of its own limits each range to its pages.
The mapping goes (``munmap``) when the last tensor viewing it does; it needs no open file. ``mmap.mmap`` would do
the same but keeps a duplicate of the file descriptor open per mapping (thousands, for a large model).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Optional

import torch

# Mappings alive at once, at most: each is one entry of the process's memory map, whose size the kernel limits
# (vm.max_map_count, 65530 by default) for every allocation of the process. Past this, ranges are read instead
# (a soft limit: the count is not locked against a finaliser running on another thread).
MAX_MAPPINGS = 16384
_live = 0


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc if hasattr(mmap, "MAP_PRIVATE") else None
    except (OSError, AttributeError):  # no POSIX mmap here: every range is read
        return None


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value


def _unmap(address: int, length: int) -> None:
    global _live
    _LIBC.munmap(address, length)
    _live -= 1


def view(fd: int, offset: int, count: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``count`` elements of ``dtype`` at byte ``offset`` of the file ``fd``, as a 1-d CPU tensor viewing a
    private mapping of their pages; None where no mapping can be made (then read the range instead)."""
    global _live
    if _LIBC is None or _live >= MAX_MAPPINGS or count == 0:
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = offset + count * dtype.itemsize - start
    address = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
    if address in (None, _FAILED):
        return None
    _live += 1
    pages = (ctypes.c_char * length).from_address(address)
    unmap = weakref.finalize(pages, _unmap, address, length)  # when torch lets go of the buffer
    unmap.atexit = False  # not at interpreter exit, where a tensor may still view it: the process's end unmaps it
    return torch.frombuffer(pages, dtype=dtype, count=count, offset=offset - start)


def live_mappings() -> int:
    return _live
