"""``rank0_reads``: rank 0 reads the weight files, the other ranks only receive (Accelerate's
``cpu_ram_efficient_loading``, for file systems where many readers are slow).

Shards stream through a bucket of fixed size: rank 0 reads every rank's next elements into it, then one scatter
gives each rank its own; a parameter larger than the bucket goes in pieces. Two buffers are allocated once and
reused: on rank 0 the bucket (``RANK0_BUCKET_BYTES``), on each rank its own part of it. So rank 0 holds its
shards plus the bucket and a rank its shards plus its part, whatever the largest tensor; and since nothing is
freed between the shards that are kept, the heap does not fragment (whole tensors received and freed one at a
time, interleaved with the kept shards, grew each rank to about the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from zero_core.layout import Range
from zero_core.pretrained.files import WeightFiles

RANK0_BUCKET_BYTES = 64 << 20  # what rank 0 reads (every rank's part) before one scatter


@dataclass
class ShardToFill:
    """This rank's shard of one parameter: elements ``[rank * size, (rank + 1) * size)`` of the flattened file
    tensor ``file_key`` (``numel`` elements; zeros past its end), in ``dtype``. ``shard``: the partition's own,
    written in place, or None until it is made."""

    file_key: str
    numel: int
    size: int
    dtype: torch.dtype
    shard: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class _Piece:
    item: ShardToFill
    start: int  # elements [start, start + length) of every rank's shard of the item
    length: int


class Rank0Reader:
    """A tensor every rank keeps whole (a buffer): rank 0 reads it and broadcasts it."""

    def __init__(self, files: WeightFiles, comm, device: torch.device):
        self.files, self.comm, self.device = files, comm, device

    def read_whole(self, key: str) -> torch.Tensor:
        info = self.files.info[key]
        value = self.files.read_whole(key).to(self.device) if self.comm.topology.rank == 0 else \
            torch.empty(info.shape, dtype=info.dtype, device=self.device)
        self.comm.broadcast(value, src=0)
        return value


def scatter_shards(items: list[ShardToFill], files: WeightFiles, comm, device: torch.device) -> None:
    """Fill every item's shard on every rank from rank 0's reads (a collective: every rank passes the same
    items, in the same order). ``device``: where the shards and buffers live (NCCL carries GPU tensors)."""
    world, rank = comm.topology.world_size, comm.topology.rank
    part_bytes = max(RANK0_BUCKET_BYTES // world, max((i.dtype.itemsize for i in items), default=1))
    send = torch.empty(part_bytes * world, dtype=torch.uint8, device=device) if rank == 0 else None
    receive = torch.empty(part_bytes, dtype=torch.uint8, device=device)
    for bucket in _buckets(items, part_bytes):
        dtype = bucket[0].item.dtype
        width = sum(piece.length for piece in bucket)  # elements per rank
        parts = None
        if rank == 0:
            parts = list(send[: width * world * dtype.itemsize].view(dtype).view(world, width))
            for r, part in enumerate(parts):
                _read_part(bucket, r, part, files)
        mine = receive[: width * dtype.itemsize].view(dtype)
        comm.scatter(mine, parts, src=0, label="pretrained weights")
        offset = 0
        for piece in bucket:
            item = piece.item
            if item.shard is None:
                item.shard = torch.empty(item.size, dtype=item.dtype, device=device)
            item.shard[piece.start: piece.start + piece.length].copy_(mine[offset: offset + piece.length])
            offset += piece.length


def _read_part(bucket: list[_Piece], rank: int, part: torch.Tensor, files: WeightFiles) -> None:
    """Rank ``rank``'s elements of every piece of the bucket, one after the other (zeros past a tensor's end)."""
    offset = 0
    for piece in bucket:
        item = piece.item
        first = min(rank * item.size + piece.start, item.numel)
        rng = Range(first, min(rank * item.size + piece.start + piece.length, item.numel))
        files.read_into(item.file_key, rng, part[offset: offset + rng.size])
        part[offset + rng.size: offset + piece.length].zero_()
        offset += piece.length


def _buckets(items: list[ShardToFill], part_bytes: int) -> Iterator[list[_Piece]]:
    """Consecutive pieces of one dtype, at most ``part_bytes`` per rank; a shard that does not fit is cut."""
    bucket: list[_Piece] = []
    used = 0
    for item in items:
        if bucket and bucket[0].item.dtype != item.dtype:
            yield bucket
            bucket, used = [], 0
        start = 0
        while start < item.size:
            length = min(item.size - start, (part_bytes - used) // item.dtype.itemsize)
            if length == 0:
                yield bucket
                bucket, used = [], 0
                continue
            bucket.append(_Piece(item, start, length))
            used += length * item.dtype.itemsize
            start += length
    if bucket:
        yield bucket
