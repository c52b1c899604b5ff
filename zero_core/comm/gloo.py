"""gloo's reduce-scatter as one all-to-all, its all-gather as broadcasts: the same bytes, about half the host time.

On gloo (the CPU backend) ``reduce_scatter_single`` and ``all_gather_single`` cost about twice the CPU time and
wall time of moving the same bytes by an ``all_to_all_single`` or by broadcasts (2 ranks, a few MiB: those
exchange every pair's slice directly, where gloo's reduce-scatter flattens and copies its input and its
all-gather runs ring steps). So on gloo the Communicator (communicator.py) routes them so:

- reduce-scatter: rank ``r`` sends row ``r`` of the rank-major input to rank ``r`` and receives every rank's
  row for itself, then sums those rows in rank order into ``output`` when the collective is waited on (in
  fp32 for 16-bit inputs, as a reduction kernel accumulates). With two ranks the sum is the same as gloo's.
- all-gather: one broadcast per rank, from its slice of ``output`` (its shard, copied there) straight into the
  same slice on every other rank.

The element counts, bytes and link classes counted are those of the collective the caller asked for.
NCCL keeps its own collectives.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


# Stage 3 gathers units of at least this many elements (1 MiB of fp32) alone, straight into place: below it, a
# collective's fixed cost (about 0.1 ms on two ranks) outweighs the copies into and out of a coalesced buffer.
ALONE_NUMEL = 1 << 18


class _ThenWork:
    """Collectives in flight, and the local step that completes the collective once they are done."""

    __slots__ = ("_works", "_then")

    def __init__(self, works: list, then: Optional[Callable[[], None]]) -> None:
        self._works = works  # kept referenced after completion (see communicator._RETAINED_WORKS)
        self._then = then

    def wait(self, timeout=None) -> bool:
        for work in self._works:  # a completed work returns at once when waited on again
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)  # raises while it still runs; the work stays valid, so this can be retried
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works) and self._then is None


def _finish(works: list, then: Optional[Callable[[], None]], async_op: bool):
    wrapped = _ThenWork(works, then)
    if not async_op:
        wrapped.wait()
    return wrapped


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                        scratch: Optional[torch.Tensor] = None):
    """``dist.reduce_scatter_single`` (sum) through one all-to-all; the sum is taken on ``wait()``. ``scratch``:
    a buffer of ``input.numel()`` elements to receive into (else one is allocated)."""
    world = dist.get_world_size(group)
    received = scratch.view(-1)[: input.numel()] if scratch is not None else torch.empty_like(input)
    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    rows = received.view(world, -1)

    def then() -> None:
        if world == 2:
            torch.add(rows[0], rows[1], out=output.view(-1))
        else:
            torch.sum(rows, dim=0, out=output.view(-1))
        if scratch is None:  # the communicator keeps recent works, and so this buffer, referenced: free it now
            received.untyped_storage().resize_(0)

    return _finish([work], then, async_op)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single`` as one broadcast per rank, each rank's shard straight from and into its slice of
    ``output`` (this rank's shard is copied into its own slice first)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = output.view(world, -1)
    if slices[rank].data_ptr() != input.data_ptr():  # in place when the caller gathers from its own slice
        slices[rank].copy_(input.reshape(-1))
    works = [dist.broadcast(slices[r], src=dist.get_global_rank(group or dist.group.WORLD, r), group=group,
                            async_op=True) for r in range(world)]
    return _finish(works, None, async_op)


def applies(group) -> bool:
    """Whether collectives over ``group`` go through this module (gloo, more than one rank)."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
