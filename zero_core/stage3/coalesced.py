"""Stage 3's coalesced collectives: one all-gather for several units, one reduce-scatter for several units' gradients.

Each unit keeps its own flat layout (layout.py; checkpoints read it), in which rank ``r`` owns the ``r``-th
slice of every bucket. A collective over several units needs the data rank-major instead: every rank's shards
of all the units side by side. So a gather copies the units' shards into one send buffer (copy-in), all-gathers
once into one receive buffer, and copies each rank's slice of each bucket into the unit's ``full`` (copy-out,
when waited on); a reduction copies the units' staged gradients rank-major into one buffer, reduce-scatters it
once, and adds each unit's slice of the result to its gradient shard. That is what FSDP2 does per group of
parameters; the copies are memory bandwidth, the saving is one collective (and its host-side cost) per unit.
A single unit with a single bucket needs no copy: it goes straight into place, as before. On CUDA both run on
their side stream (streams.py): ``issue`` where they start, ``complete`` where they are waited for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from zero_core.stage3.streams import complete, issue

if TYPE_CHECKING:
    from zero_core.comm.communicator import Communicator
    from zero_core.stage3.param_unit import ParamUnit


def _label(units: Sequence["ParamUnit"]) -> str:
    first = units[0].module_name or "<root>"
    return first if len(units) == 1 else f"{first} (+{len(units) - 1} units)"


class CoalescedGather:
    """One all-gather in flight for several units; ``wait`` completes it and fills every unit's ``full`` (their
    storage must be allocated before)."""

    def __init__(self, units: Sequence["ParamUnit"], comm: "Communicator",
                 stream: Optional[torch.cuda.Stream] = None) -> None:
        self.units = list(units)
        self._stream = stream  # CUDA: the gather stream (streams.py); None: in program order
        with issue(stream):
            self._start(comm)

    def _start(self, comm: "Communicator") -> None:
        world = comm.topology.world_size
        shard_total = sum(u.layout.shard_numel for u in self.units)
        first = self.units[0]
        self._in_place = len(self.units) == 1 and len(first.layout.buckets) == 1  # rank-major already
        if len(self.units) > 1 and all(u.swap is None and u.shard.device == first.device for u in self.units):
            send = torch.cat([u.shard for u in self.units])  # copy-in, one op
        elif len(self.units) > 1:  # offload_param: each unit's source (a pool buffer) is free once copied in
            send = torch.empty(shard_total, dtype=first.dtype, device=first.device)
            for unit, chunk in zip(self.units, send.split([u.layout.shard_numel for u in self.units])):
                chunk.copy_(unit.gather_source())
                unit.drop_gather_source()
        else:
            send = first.gather_source()  # held by the unit until its wait()
        self._recv: Optional[torch.Tensor] = (
            first.full if self._in_place else torch.empty(world * shard_total, dtype=first.dtype, device=first.device))
        # Buffers of this batch alone (not a unit's own storage): freed once copied out.
        self._scratch = ([] if self._in_place else [self._recv]) + ([send] if len(self.units) > 1 else [])
        self._shard_total = shard_total
        self._work = comm.all_gather(self._recv, send, async_op=True, label=_label(self.units))

    def wait(self) -> None:
        if self._recv is None:
            return
        with complete(self._stream):  # the parameters are used (and the scratch reused) after the copy-out
            self._finish()

    def _finish(self) -> None:
        if self._work is not None:
            self._work.wait()
        if not self._in_place:  # one copy-out op into every bucket of every unit
            targets = [view for unit in self.units for view in unit.rank_views]
            torch.split_with_sizes_copy(self._recv.view(-1, self._shard_total), [t.shape[1] for t in targets], dim=1,
                                        out=targets)
        # The comm layer keeps its latest works (and so their tensors) referenced (Communicator's _RETAINED_WORKS):
        # free the send and receive buffers' memory now, or a few batches' worth would stay allocated.
        for scratch in self._scratch:
            scratch.untyped_storage().resize_(0)
        self._recv, self._work, self._scratch = None, None, []

    def drop(self) -> None:
        """Forget the collective without waiting (teardown after the process group is gone)."""
        self._recv, self._work = None, None


class ReduceBucket:
    """Gradients of consecutive units staged rank-major for one reduce-scatter: row ``r`` of the buffer holds
    what rank ``r`` receives, each unit's shard-shaped part side by side (``ParamUnit.stage_grads`` writes
    there directly, so there is no second copy). Rows are sized for a full bucket, or for the units planned
    for it (``per_rank``, gradients.py); ``send`` closes the gaps of a bucket that is sent partly filled."""

    def __init__(self, buffer: torch.Tensor, world: int, per_rank: Optional[int] = None) -> None:
        self.buffer, self.world = buffer, world
        self.per_rank = buffer.numel() // world if per_rank is None else per_rank  # columns
        self.by_rank = buffer[: world * self.per_rank].view(world, self.per_rank)
        self.units: list = []
        self.filled = 0  # columns used

    def fits(self, unit: "ParamUnit") -> bool:
        return self.filled + unit.layout.shard_numel <= self.per_rank

    def add(self, unit: "ParamUnit") -> list[str]:
        missing = unit.stage_grads(self.by_rank, self.filled)
        self.units.append(unit)
        self.filled += unit.layout.shard_numel
        return missing

    def send(self) -> torch.Tensor:
        """The buffer as the reduce-scatter input: ``world`` rows of ``filled`` elements, contiguous."""
        width = self.filled
        if width < self.per_rank:
            for row in range(1, self.world):
                source = self.buffer[row * self.per_rank : row * self.per_rank + width]
                if row * self.per_rank < (row + 1) * width:  # overlapping ranges: copy through a temporary
                    source = source.clone()
                self.buffer[row * width : (row + 1) * width].copy_(source)
        return self.buffer[: self.world * width]


class CoalescedReduce:
    """A full (or final) ``ReduceBucket`` averaged over ranks with one reduce-scatter; ``finish`` waits and adds
    each unit's part to its gradient shard."""

    def __init__(self, bucket: ReduceBucket, comm: "Communicator", async_op: bool,
                 stream: Optional[torch.cuda.Stream] = None) -> None:
        self.units = bucket.units
        self._stream = stream  # CUDA: the reduce stream (streams.py); None: in program order
        with issue(stream):  # after the compute stream staged the gradients
            self._start(bucket, comm, async_op)

    def _start(self, bucket: ReduceBucket, comm: "Communicator", async_op: bool) -> None:
        send = bucket.send()
        send.div_(bucket.world)
        first = self.units[0]
        # A bucket sized for its units leaves the rest of its pool buffer free: the result, and the transport's
        # receive buffer (comm.reduce_scatter's scratch), go there rather than into fresh allocations.
        spare = bucket.buffer[send.numel():]
        if bucket.world == 1:
            # One rank: the reduce-scatter's sum is its input, so it is reduced in place (NCCL's in-place form,
            # output = input's own slice). A bucket sized for every unit (one GPU) leaves no spare, and a fresh
            # result would double the end of backward's gradient memory (docs/stage3.md, "Activation checkpoints").
            self.result = send
        elif spare.numel() >= bucket.filled:
            self.result, spare = spare[: bucket.filled], spare[bucket.filled:]
        else:
            self.result = torch.empty(bucket.filled, dtype=first.dtype, device=first.device)
        self._work = comm.reduce_scatter(self.result, send, async_op=async_op, label=_label(self.units),
                                         segments=[unit.layout.shard_numel for unit in self.units], scratch=spare)

    def finish(self) -> None:
        """Add the reduced parts into the gradient shards; on CUDA the current stream then waits for that (the
        shards are read and the staging buffer is reused after)."""
        # A shard whose memory was given back after the last step (grad_memory.py) is allocated and zeroed here, on
        # the compute stream, which the reduce stream then waits for (its first write must come after).
        restored = [unit.grad_shard for unit in self.units if unit.grads_released()]
        if restored and self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with complete(self._stream):
            if self._work is not None:
                self._work.wait()
            parts = self.result.split([unit.layout.shard_numel for unit in self.units])
            torch._foreach_add_([unit.grad_shard for unit in self.units], parts)
        self._work = None
