"""Stage 3's coalesced collectives: one all-gather for several units, one reduce-scatter for several units' gradients.

Each unit keeps its own flat layout (layout.py; checkpoints read it), in which rank ``r`` owns the ``r``-th
slice of every bucket. A collective over several units needs the data rank-major instead: every rank's shards
of all the units side by side. So a gather copies the units' shards into one send buffer (copy-in), all-gathers
once into one receive buffer, and copies each rank's slice of each bucket into the unit's ``full`` (copy-out,
when waited on); a reduction copies the units' staged gradients rank-major into one buffer, reduce-scatters it
once, and adds each unit's slice of the result to its gradient shard. That is what FSDP2 does per group of
parameters; the copies are memory bandwidth, the saving is one collective (and its host-side cost) per unit.
A single unit with a single bucket needs no copy: it goes straight into place, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from .comm import Communicator
    from .param_unit import ParamUnit


def _label(units: Sequence["ParamUnit"]) -> str:
    first = units[0].module_name or "<root>"
    return first if len(units) == 1 else f"{first} (+{len(units) - 1} units)"


class CoalescedGather:
    """One all-gather in flight for several units; ``wait`` completes it and fills every unit's ``full`` (their
    storage must be allocated before)."""

    def __init__(self, units: Sequence["ParamUnit"], comm: "Communicator") -> None:
        self.units = list(units)
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
                unit._drop_source()
        else:
            send = first.gather_source()  # held by the unit until its wait()
        self._recv: Optional[torch.Tensor] = (
            first.full if self._in_place else torch.empty(world * shard_total, dtype=first.dtype, device=first.device))
        self._shard_total = shard_total
        self._work = comm.all_gather(self._recv, send, async_op=True, label=_label(self.units))

    def wait(self) -> None:
        if self._recv is None:
            return
        if self._work is not None:
            self._work.wait()
        if not self._in_place:  # one copy-out op into every bucket of every unit
            targets = [view for unit in self.units for view in unit.rank_views]
            torch.split_with_sizes_copy(self._recv.view(-1, self._shard_total), [t.shape[1] for t in targets], dim=1,
                                        out=targets)
        self._recv, self._work = None, None

    def drop(self) -> None:
        """Forget the collective without waiting (teardown after the process group is gone)."""
        self._recv, self._work = None, None


class CoalescedReduce:
    """Gradients of several units (staged in unit layout, side by side in ``staging``) averaged over ranks with
    one reduce-scatter; ``finish`` waits and adds each unit's part to its gradient shard."""

    def __init__(self, units: Sequence["ParamUnit"], staging: torch.Tensor, comm: "Communicator",
                 async_op: bool) -> None:
        self.units = list(units)
        world = comm.topology.world_size
        total = sum(u.numel for u in self.units)
        shard_total = total // world
        staging[:total].div_(world)
        first = self.units[0]
        if len(self.units) == 1 and len(first.layout.buckets) == 1:
            send = staging[:total]  # already rank-major: no copy
        else:  # one copy-in op: every bucket of every unit, rank-major
            send = torch.empty(total, dtype=first.dtype, device=first.device)
            pieces, start = [], 0
            for unit in self.units:
                pieces += [staging[start + b.range.start : start + b.range.end].view(world, b.shard_size)
                           for b in unit.layout.buckets]
                start += unit.numel
            torch.cat(pieces, dim=1, out=send.view(world, shard_total))
        self._send = send
        self.result = torch.empty(shard_total, dtype=first.dtype, device=first.device)
        self._work = comm.reduce_scatter(self.result, send, async_op=async_op, label=_label(self.units))

    def finish(self) -> None:
        if self._work is not None:
            self._work.wait()
        parts = self.result.split([unit.layout.shard_numel for unit in self.units])
        torch._foreach_add_([unit.grad_shard for unit in self.units], parts)
        self._send, self._work = None, None
