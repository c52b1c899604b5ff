"""The only place that calls collectives: every call is counted, so tests and benchmarks can check volumes.

Elements are counted as the size of the whole (unsharded) tensor a collective covers: the input of a
reduce-scatter, the output of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the
ZeRO paper's volumes (2Ψ per step for stages 1 and 2).
"""

from __future__ import annotations

import os
from collections import defaultdict, deque
from typing import Optional

import torch
import torch.distributed as dist

from .collective_guard import Call, CollectiveGuard
from .topology import Topology

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

# Work handles of the latest collectives stay referenced here (see Communicator._run). gloo's worker thread
# drops its own reference to a work just after completing it; if that is the last reference, it frees the
# work's tensors there, which takes the GIL to release their Python objects. Near interpreter exit that thread
# finds Python finalising and the process aborts ("terminate called without an active exception"). Kept here,
# a recent work is freed by Python's own thread; by the time 8 later ones have completed, gloo's few worker
# threads (2 by default) have long let go of it. The cost: at most 8 collectives' tensors stay alive, mostly
# views of buffers the engine keeps anyway.
_RETAINED_WORKS = 8


class Communicator:
    """Collectives over one topology's shard group, with per-collective counters."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "elements": 0, "bytes": 0})
        # Debug mode (DESIGN.md): before each collective, every rank shows what it is about to call, so a
        # mismatch becomes an error naming both sides instead of a hang. Stage 3 also turns it on while it
        # records its first trace.
        self.always_check = os.environ.get("ZERO_CORE_CHECK_COLLECTIVES", "0") == "1"
        self.check = self.always_check
        # Always on (collective_guard.py): a fingerprint per call, a step barrier and a stall watchdog.
        self.guard = CollectiveGuard(topology)
        self._recent_works: deque = deque(maxlen=_RETAINED_WORKS)  # see _RETAINED_WORKS

    def _verify(self, name: str, tensor: torch.Tensor, label: str) -> None:
        mine = (name, tensor.numel(), str(tensor.dtype), label)
        everyone: list = [None] * self.topology.world_size
        dist.all_gather_object(everyone, mine, group=self.topology.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(
                    f"collective mismatch: rank {self.topology.rank} calls {name} of {mine[1]} {mine[2]} elements "
                    f"for '{label}', but rank {rank} calls {theirs[0]} of {theirs[1]} {theirs[2]} elements for "
                    f"'{theirs[3]}'. Every rank must run the same modules in the same order."
                )

    def _count(self, name: str, tensor: torch.Tensor, label: str = "") -> Optional[Call]:
        if self.check:
            self._verify(name, tensor, label)
        entry = self._stats[name]
        entry["calls"] += 1
        entry["elements"] += tensor.numel()
        entry["bytes"] += tensor.numel() * tensor.element_size()
        return self.guard.record(name, tensor.numel(), tensor.dtype, label)

    def _issue(self, call: Optional[Call], async_op: bool, launch) -> Optional[dist.Work]:
        """Launch a collective; with the guard on, its wait goes through the stall watchdog."""
        work = launch(True)  # always async, so that its handle can be kept (see _RETAINED_WORKS)
        if work is not None:
            self._recent_works.append(work)
        if call is None:
            if not async_op and work is not None:
                work.wait()
            return work if async_op else None
        if not async_op:
            self.guard.wait(work, call)
            return None
        return _GuardedWork(work, call, self.guard)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = ""
    ) -> Optional[dist.Work]:
        """Sum ``input`` over ranks; this rank receives its equal slice in ``output``."""
        call = self._count("reduce_scatter", input, label)
        return self._issue(call, async_op, lambda a: _reduce_scatter(output, input, group=self.topology.group, async_op=a))

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = ""
    ) -> Optional[dist.Work]:
        """Concatenate every rank's ``input`` into ``output`` in rank order."""
        call = self._count("all_gather", output, label)
        return self._issue(call, async_op, lambda a: _all_gather(output, input, group=self.topology.group, async_op=a))

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False
    ) -> Optional[dist.Work]:
        call = self._count("all_reduce", tensor)
        return self._issue(call, async_op, lambda a: dist.all_reduce(tensor, op=op, group=self.topology.group, async_op=a))

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[dist.Work]:
        """Broadcast from shard-group rank ``src``."""
        call = self._count("broadcast", tensor)
        root = self.topology.global_rank(src)
        return self._issue(call, async_op, lambda a: dist.broadcast(tensor, src=root, group=self.topology.group, async_op=a))

    def stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes per collective since the last reset."""
        return {name: dict(entry) for name, entry in self._stats.items()}

    def reset(self) -> None:
        self._stats.clear()


class _GuardedWork:
    """An async collective's handle whose wait() goes through the guard's stall watchdog."""

    __slots__ = ("_work", "_call", "_guard")

    def __init__(self, work: dist.Work, call: Call, guard: CollectiveGuard) -> None:
        self._work, self._call, self._guard = work, call, guard

    def wait(self) -> bool:
        self._guard.wait(self._work, self._call)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()
