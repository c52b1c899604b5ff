"""A master piece bigger than the NVMe tile, read and written outside the step a slice at a time.

The step reads such a piece in slices (nvme_slices.py), and checkpoints do too: a save streams each of the piece's
regions (its master, each optimizer state tensor) to the checkpoint file a slice of at most a tile at a time, and a
load fills them a slice at a time from the checkpoint, writing the master's slices into the model's parameter shard
as well. Each holds two slices of one region (the one in use and the next, read or written meanwhile), where the
piece read whole held 12 bytes for each of its elements: 25 GiB for a 128k x 4096 embedding at world size 1.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from zero_core.offload.aio import Transfer
from zero_core.offload.nvme_swap import _MASTER, NvmeSwapper

# (start, end, slice): make elements [start, end) of a region (indices into the piece) in the flat slice buffer
Fill = Callable[[int, int, torch.Tensor], None]


def _cuts(start: int, end: int, tile_numel: int) -> list[tuple[int, int]]:
    return [(a, min(a + tile_numel, end)) for a in range(start, end, tile_numel)]


class PieceInFile:
    """One swapped-out master piece bigger than a tile, with what holds its values in the model: the ``target``
    (the slice of the model's parameter shard the piece writes back into, made in memory by ``shard_in_memory``:
    offload_param nvme swaps the shard itself)."""

    def __init__(self, swapper: NvmeSwapper, master: torch.Tensor, tile_numel: int, shard_in_memory: Callable,
                 target: Callable[[], torch.Tensor]) -> None:
        self.swapper = swapper
        self.master = master
        self.tile_numel = tile_numel
        self.shard_in_memory = shard_in_memory
        self.target = target
        self.shape, _ = swapper.shape_of(master, _MASTER)

    def read(self, key: Optional[str], start: int, end: int) -> Iterator[torch.Tensor]:
        """Elements ``[start, end)`` of the master (``key`` None) or of its optimizer state ``key``, in flat slices
        of at most a tile: each read while the one before is used, and given back (unwritten: the file holds its
        values) when the caller asks for the next one or stops."""
        region = _MASTER if key is None else str(key)
        cuts = _cuts(start, end, self.tile_numel)

        def read(a: int, b: int) -> tuple[torch.Tensor, Transfer]:
            transfer = Transfer()
            buffer = self.swapper.read_slice(transfer, self.master, region, a, b)
            if not self.swapper.pool.overlap:
                transfer.wait()
            return buffer, transfer

        upcoming = read(*cuts[0]) if cuts else None
        try:
            for index in range(len(cuts)):
                buffer, transfer = upcoming
                upcoming = None
                try:
                    transfer.wait()
                    if index + 1 < len(cuts):
                        upcoming = read(*cuts[index + 1])
                    yield buffer
                finally:
                    self.swapper.release_slice(buffer)
        finally:  # the caller stopped early (an error): the slice read ahead is given back too
            if upcoming is not None:
                upcoming[1].wait()
                self.swapper.release_slice(upcoming[0])

    def claim(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A region for optimizer state ``key`` (the master's shape), to be written whole by :meth:`write`; the
        state's tensor in memory, empty as it is while swapped out."""
        self.swapper.claim(self.master, str(key), self.shape, dtype)
        return torch.empty(0, dtype=dtype)

    def write(self, key: Optional[str], start: int, end: int, fill: Fill) -> None:
        """Elements ``[start, end)`` of the master (``key`` None; also into the model's parameter shard) or of its
        optimizer state ``key``, each slice made by ``fill`` and written out while the next one is made."""
        region = _MASTER if key is None else str(key)
        dtype = self.swapper.shape_of(self.master, region)[1]
        writing: Optional[Transfer] = None
        try:
            with torch.no_grad(), self.shard_in_memory() if key is None else contextlib.nullcontext():
                target = self.target() if key is None else None
                for a, b in _cuts(start, end, self.tile_numel):
                    buffer = self.swapper.new_slice(dtype, b - a)
                    try:
                        fill(a, b, buffer)
                        if target is not None:
                            target[a:b].copy_(buffer)
                    except BaseException:
                        self.swapper.release_slice(buffer)
                        raise
                    if writing is not None:
                        writing.wait()  # one write in flight
                    writing = self.swapper.write_slices(self.master, a, [(region, buffer)])
        finally:
            if writing is not None:
                writing.wait()
