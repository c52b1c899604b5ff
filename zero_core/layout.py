"""Where every parameter sits in a flat buffer, and which part each rank owns.

This is the one pure layout function of the project: allocation, gradient reduction, checkpoints and the
memory estimator all read the same `FlatLayout`, so they can never disagree.

Index spaces (all in elements):
- *flat offset*: position inside one flat buffer (one per optimizer group and dtype), padding included.
- *bucket offset*: position inside one bucket, ``flat offset - bucket.range.start``.
- *shard offset*: position inside one rank's shard of one bucket, ``bucket offset - rank * bucket.shard_size``.
- *param offset*: position inside one flattened parameter.

The buffer is cut into buckets at parameter boundaries. Each bucket is padded to a multiple of the world size
and rank ``r`` owns the ``r``-th equal slice of every bucket, so one ``reduce_scatter_tensor`` per bucket lands
each rank's gradients in its own slice, and one ``all_gather_into_tensor`` per bucket rebuilds the parameters.

With an ``alignment`` of ``A`` elements (``shard_alignment`` in the config; 64 on CUDA, 1 elsewhere: see
planning.py), every parameter starts at a multiple of ``A`` (zeros fill the gap after the previous one) and
every bucket is padded to a multiple of ``A * world_size``, so every rank's shard also starts and ends on a
multiple of ``A``: collectives and kernels read aligned memory. Padding, wherever it sits, belongs to no
parameter: it holds zeros, has no fp32 master and no optimizer state, and is never checkpointed (checkpoints
store each parameter's elements by parameter offset, so they load at any alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


@dataclass(frozen=True)
class Range:
    """A half-open interval ``[start, end)`` of element indices."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"Range end {self.end} is before its start {self.start}")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Range") -> Optional["Range"]:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> "Range":
        return Range(self.start + offset, self.end + offset)

    def as_slice(self) -> slice:
        return slice(self.start, self.end)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place: its index in the ordered list, its bucket and its flat range."""

    index: int
    bucket: int
    range: Range


@dataclass(frozen=True)
class BucketLayout:
    """A padded run of whole parameters; every rank owns ``shard_size`` elements of it."""

    index: int
    range: Range
    param_indices: tuple[int, ...]
    world_size: int

    @property
    def shard_size(self) -> int:
        return self.range.size // self.world_size

    def shard_range(self, rank: int) -> Range:
        """The flat range that ``rank`` owns in this bucket."""
        start = self.range.start + rank * self.shard_size
        return Range(start, start + self.shard_size)


@dataclass(frozen=True)
class ShardFragment:
    """The part of one parameter that one rank owns inside one bucket."""

    param_index: int
    bucket: int
    param_range: Range  # param offsets
    shard_range: Range  # offsets inside the rank's shard of that bucket


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one flat buffer for ``world_size`` ranks."""

    world_size: int
    numels: tuple[int, ...]
    slots: tuple[ParamSlot, ...]
    buckets: tuple[BucketLayout, ...]
    alignment: int = 1  # parameter starts and shard boundaries are multiples of this many elements

    @property
    def total(self) -> int:
        """Padded size of the whole flat buffer."""
        return self.buckets[-1].range.end if self.buckets else 0

    @property
    def numel(self) -> int:
        """Unpadded element count (the parameters alone)."""
        return sum(self.numels)

    @property
    def padding(self) -> int:
        """Elements that hold no parameter: between parameters (alignment) and at the end of each bucket."""
        return self.total - self.numel

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns over all buckets (padding included)."""
        return self.total // self.world_size

    def shard_offsets(self) -> list[int]:
        """Where each bucket's shard starts inside one rank's concatenated shards."""
        offsets, running = [], 0
        for bucket in self.buckets:
            offsets.append(running)
            running += bucket.shard_size
        return offsets

    def fragments(self, rank: int) -> Iterator[ShardFragment]:
        """Every (parameter, bucket) piece that ``rank`` owns, in flat order."""
        for bucket in self.buckets:
            owned = bucket.shard_range(rank)
            for index in bucket.param_indices:
                slot = self.slots[index]
                overlap = slot.range.intersect(owned)
                if overlap is None:
                    continue
                yield ShardFragment(
                    param_index=index,
                    bucket=bucket.index,
                    param_range=overlap.shift(-slot.range.start),
                    shard_range=overlap.shift(-owned.start),
                )


def _pad(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def compute_layout(numels: Sequence[int], world_size: int, bucket_numel: int, alignment: int = 1) -> FlatLayout:
    """Pack parameters in order into buckets of at most ``bucket_numel`` elements (alignment gaps included).

    A parameter never straddles two buckets; one larger than ``bucket_numel`` gets a bucket of its own. Each
    parameter starts at a multiple of ``alignment`` and each bucket is padded at its end to a multiple of
    ``alignment * world_size``, so each rank's shard of a bucket is a multiple of ``alignment`` long. With
    ``alignment=1`` parameters are packed back to back and buckets padded to a multiple of ``world_size``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if int(alignment) != alignment or alignment < 1:
        raise ValueError(f"alignment must be an integer >= 1 (elements), got {alignment!r}")
    if any(n < 0 for n in numels):
        raise ValueError("parameter sizes must be >= 0")
    alignment = int(alignment)
    bucket_numel = max(int(bucket_numel), 1)
    groups: list[list[int]] = []
    filled = 0  # elements used in the current bucket, up to the end of its last parameter
    for index, numel in enumerate(numels):
        if not groups or (_pad(filled, alignment) + numel > bucket_numel and filled > 0):
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled = _pad(filled, alignment) + numel
    slots: list[Optional[ParamSlot]] = [None] * len(numels)
    buckets = []
    cursor = 0
    for bucket_index, members in enumerate(groups):
        start = cursor  # a multiple of alignment * world_size: every bucket before is
        for index in members:
            cursor = start + _pad(cursor - start, alignment)
            slots[index] = ParamSlot(index, bucket_index, Range(cursor, cursor + numels[index]))
            cursor += numels[index]
        end = start + _pad(max(cursor - start, 1), world_size * alignment)
        buckets.append(BucketLayout(bucket_index, Range(start, end), tuple(members), world_size))
        cursor = end
    return FlatLayout(world_size, tuple(int(n) for n in numels), tuple(slots), tuple(buckets), alignment)
