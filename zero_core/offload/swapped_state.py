"""What an NVMe offload swaps, and reading it outside the step.

A master piece goes to the swap file together with every optimizer state tensor shaped like it (Adam's moments;
scalars such as ``step`` stay in memory). While swapped out a tensor is empty, so its shape in memory is the file's
record of it. Checkpoints, full state dicts, the debugging API and ``GatheredParameters`` read the state through
:meth:`SwappedState.stream` (a few tiles at a time) or :meth:`SwappedState.resident` (some pieces, or everything
for a while). Without a swap file (device ``cpu``) both give everything at once: it is in memory.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from zero_core.offload.aio import Transfer
from zero_core.offload.host_masters import write_back_pieces
from zero_core.offload.nvme_swap import _MASTER, NvmeSwapper, split_into_tiles
from zero_core.offload.piece_in_file import PieceInFile


class SwappedState:
    """The masters and optimizer state of one offload, swapped to ``swapper``'s file (None: kept in memory)."""

    def __init__(self, swapper: Optional[NvmeSwapper], sub_group_size: int) -> None:
        self.swapper = swapper
        self.sub_group_size = sub_group_size  # elements per tile that stream() holds, at most
        self.optimizers: list[torch.optim.Optimizer] = []
        self._resident_depth = 0

    def bind(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The inner optimizers whose state is swapped with the masters (set again by replace_optimizers)."""
        self.optimizers = list(optimizers)

    def state_of(self, master: nn.Parameter) -> dict:
        for optimizer in self.optimizers:
            if master in optimizer.state:
                return optimizer.state[master]
        return {}

    def items(self, masters, state: bool = True) -> Iterator[tuple]:
        """A master and (``state``) every optimizer state tensor shaped like it (scalars such as ``step`` stay in
        memory)."""
        for master in masters:
            yield master, _MASTER, master
            if not state:
                continue
            for key, value in self.state_of(master).items():
                # master.shape: both resident; (0,): swapped out (the master may already be back in)
                if torch.is_tensor(value) and value.dim() > 0 and value.shape in (master.shape, torch.Size([0])):
                    yield master, str(key), value

    def numel_in_file(self, master: torch.Tensor) -> int:
        """``master``'s elements, whether it is in memory or swapped out (then its tensor is empty)."""
        return (self.shape_in_memory(master) or master.shape).numel()

    def shape_in_memory(self, master: torch.Tensor, key=None) -> Optional[torch.Size]:
        """The shape ``master`` (``key`` None) or its optimizer state ``key`` has in memory while it is swapped
        out to NVMe; None while it is in memory (or nothing is swapped)."""
        tensor = master if key is None else self.state_of(master).get(key)
        if self.swapper is None or not torch.is_tensor(tensor) or tensor.numel():
            return None
        found = self.swapper.shape_of(master, _MASTER if key is None else str(key))
        return found[0] if found is not None else None

    def stream(self, masters: list, parts: list, write: bool = False) -> Iterator[list]:
        """``masters`` (pieces of ``parts``, in order) in tiles of at most ``sub_group_size`` elements (a bigger
        piece alone), each in memory with its optimizer state while the caller holds it (until it asks for the next
        tile): the next tile is read meanwhile, and a tile the caller is done with is dropped (``write`` False: it
        only read it, the file holds the same values) or written back into the model's parameter shards and out to
        the file (``write``: it changed the masters or replaced their state), its write overlapping the next tile.
        So a checkpoint holds a few tiles in memory, never the whole state. A swapped-out piece bigger than a tile
        (:meth:`in_slices`) is a tile of its own that stays in the file: the caller reads and writes it a slice
        at a time through :meth:`in_file`. Without a swap file, or inside :meth:`resident`, one tile of
        everything."""
        swap = self.swapper
        if swap is None or self._resident_depth:
            yield list(masters)
            return
        tiles = split_into_tiles(masters, self.numel_in_file, self.sub_group_size)
        where = {id(m): (part, index) for part in parts for index, m in enumerate(part.masters)}

        def read(tile: list) -> tuple[Optional[list], Transfer]:
            if self.in_slices(tile[0]):
                return None, Transfer()  # left in the file: the caller reads it in slices (in_file)
            items = [item for item in self.items(tile) if not item[2].numel()]  # swapped out: read in
            return items, swap.swap_in(items)

        def done(tile: list, items: Optional[list]) -> Optional[Transfer]:
            if items is None:
                return None  # in slices: the caller wrote what it changed (PieceInFile.write)
            if not write:
                swap.drop(items)
                return None
            write_back_pieces([(m, None, *where[id(m)]) for m in tile if id(m) in where])
            return swap.swap_out(self.items(tile))

        reading = read(tiles[0]) if tiles else None
        writing: Optional[Transfer] = None
        current = None
        try:
            for index, tile in enumerate(tiles):
                items, transfer = reading
                reading = None
                transfer.wait()
                if index + 1 < len(tiles):
                    reading = read(tiles[index + 1])
                    if not swap.pool.overlap:
                        reading[1].wait()
                current = (tile, items)
                yield tile
                current = None
                finished = done(tile, items)
                if writing is not None:
                    writing.wait()
                writing = finished
                if writing is not None and not swap.pool.overlap:
                    writing.wait()
        finally:  # also when the caller stopped early (an error): nothing in memory or in flight is left behind
            if current is not None:
                finished = done(*current)
                if finished is not None:
                    finished.wait()
            if reading is not None:
                reading[1].wait()
                swap.drop(reading[0])
            if writing is not None:
                writing.wait()

    def in_slices(self, master: torch.Tensor) -> bool:
        """Whether ``master`` is swapped out and bigger than a tile: :meth:`stream` leaves it in the file."""
        return (self.swapper is not None and not self._resident_depth and not master.numel()
                and self.numel_in_file(master) > self.sub_group_size)

    def in_file(self, master: torch.Tensor, parts: list) -> Optional[PieceInFile]:
        """``master`` (a piece of one of ``parts``) to read and write a slice at a time where :meth:`in_slices`;
        else None (:meth:`stream` brings it in whole)."""
        if not self.in_slices(master):
            return None
        for part in parts:
            for index, piece in enumerate(part.masters):
                if piece is master:
                    return PieceInFile(self.swapper, master, self.sub_group_size, part.shard_in_memory,
                                       lambda: part.master_shards.piece_shard(part.param_shards(), index))
        raise KeyError("this master piece belongs to no offloaded part (a bug in the engine: please report it)")

    @contextlib.contextmanager
    def resident(self, every_master: Callable[[], list], masters: Optional[list] = None, state: bool = True,
                 write: bool = True) -> Iterator[None]:
        """Everything (``every_master()``) in memory for the duration (GatheredParameters). Or only ``masters``,
        with their optimizer state if ``state``: what the debugging API and full state dicts read for one
        parameter at a time, so the swapped state never comes in all at once; afterwards written out again if
        ``write`` (the caller changed it), else dropped (the file holds the same values)."""
        if self.swapper is None or self._resident_depth:
            yield
            return
        if masters is not None:
            items = [item for item in self.items(masters, state) if not item[2].numel()]  # swapped out
            self.swapper.swap_in(items).wait()
            try:
                yield
            finally:
                if write:
                    self.swapper.swap_out(items).wait()
                else:
                    self.swapper.drop(items)
            return
        self.swapper.swap_in(self.items(every_master())).wait()
        self._resident_depth += 1
        try:
            yield
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0:
                self.swapper.swap_out(self.items(every_master())).wait()
