"""Where DeepSpeed's ZeRO keeps each parameter's elements: a pure function of shapes and partition sizes.

Index spaces: a *flat* is one tensor of a rank's optimizer file (``single_partition_of_fp32_groups[g]`` in
stages 1/2, ``fp32_flat_groups[i]`` in stage 3), numbered in file order; a *piece* maps elements
``[param_start, param_start + size)`` of one flattened parameter to ``[flat_start, flat_start + size)`` of flat
``flat`` on rank ``rank``. Optimizer state tensors have their flat's shape, so the same pieces address them.

- Stages 1/2: per parameter group, the parameters (``param_shapes[g]``, in order, each followed by its
  ``param_alignment_paddings`` entry when the file has one) are laid end to end in one buffer, padded at the end,
  and cut into ``partition_count`` equal partitions, rank r holding the r-th.
- Stage 3: every parameter is padded to a multiple of the world size and split evenly: rank r holds elements
  ``[r*c, (r+1)*c)`` (c = ceil(numel / world)) at the same offset of each rank's flats laid end to end, the
  parameters in ``param_shapes`` order across groups.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from zero_core.checkpoint.format import CheckpointError


class Piece(NamedTuple):
    rank: int
    flat: int
    flat_start: int
    param_start: int
    size: int


def stage12_pieces(group_shapes: Sequence[dict], partition_sizes: Sequence[int], world: int,
                   paddings: Optional[Sequence[Sequence[int]]] = None) -> dict[str, list[Piece]]:
    """Pieces of every parameter; ``partition_sizes[g]`` is the length of group g's flat on every rank."""
    pieces: dict[str, list[Piece]] = {}
    for group, (shapes, partition) in enumerate(zip(group_shapes, partition_sizes)):
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            pieces[name] = _split(offset, numel, partition, group, world, name)
            offset += numel + (paddings[group][index] if paddings is not None else 0)
        if offset > partition * world:
            raise CheckpointError(f"DeepSpeed parameter group {group} holds {offset} elements but its partitions "
                                  f"only {partition} x {world}: the files do not match their param_shapes")
    return pieces


def _split(offset: int, numel: int, partition: int, group: int, world: int, name: str) -> list[Piece]:
    out, done = [], 0
    while done < numel:
        position = offset + done
        rank, start = divmod(position, partition) if partition else (world, 0)
        if rank >= world:
            raise CheckpointError(f"'{name}' lies beyond the {world} partitions of DeepSpeed parameter group {group}")
        size = min(numel - done, partition - start)
        out.append(Piece(rank, group, start, done, size))
        done += size
    return out


def stage3_pieces(shapes: dict, flat_sizes: Sequence[int], world: int) -> dict[str, list[Piece]]:
    """Pieces of every parameter; ``shapes`` in order across groups, ``flat_sizes`` the lengths of one rank's
    flats (the same on every rank)."""
    bounds = [0]
    for size in flat_sizes:
        bounds.append(bounds[-1] + size)
    pieces: dict[str, list[Piece]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        chunk = -(-numel // world)
        if offset + chunk > bounds[-1]:
            raise CheckpointError(f"'{name}' lies beyond DeepSpeed's stage 3 flats ({bounds[-1]} elements per rank): "
                                  "the files do not match their param_shapes")
        pieces[name] = [piece for rank in range(world)
                        for piece in _in_flats(rank, offset, rank * chunk, min(chunk, numel - rank * chunk), bounds)]
        offset += chunk
    if offset != bounds[-1]:
        raise CheckpointError(f"DeepSpeed's stage 3 flats hold {bounds[-1]} elements per rank, the parameters "
                              f"need {offset}: the files do not match their param_shapes")
    return pieces


def _in_flats(rank: int, local: int, param_start: int, size: int, bounds: list[int]) -> list[Piece]:
    """A rank's run of ``size`` elements at ``local`` in its flats laid end to end, cut at flat boundaries."""
    out = []
    while size > 0:
        flat = next(i for i in range(len(bounds) - 1) if bounds[i] <= local < bounds[i + 1])
        take = min(size, bounds[flat + 1] - local)
        out.append(Piece(rank, flat, local - bounds[flat], param_start, take))
        local, param_start, size = local + take, param_start + take, size - take
    return out
