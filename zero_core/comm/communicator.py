"""The only place that calls collectives: every call is counted, so tests and benchmarks can check volumes.

Elements are counted as the size of the whole (unsharded) tensor a collective covers: the input of a
reduce-scatter, the output of an all-gather, the tensor of an all-reduce or broadcast. That is the unit of the
ZeRO paper's volumes (2Ψ per step for stages 1 and 2). ``bytes`` is that whole in the dtype on the wire (int8 or
packed int4 codes plus their scales under ZeRO++ quantisation).

Link classes: for every collective (and every hop of a hierarchical one) the bytes this rank *sends* to each other
member are added to ``in_node_bytes`` or ``cross_node_bytes`` by the member's node (topology.py). The model is
the direct exchange, independent of the transport's algorithm: an all-gather sends this rank's shard to every
other member, a reduce-scatter and an all-to-all one slice to each, an all-reduce twice its 1/n slice (a
reduce-scatter then an all-gather), a broadcast the whole tensor from the root to each member.

ZeRO++ and MiCS paths (docs/multinode.md) live in ``zero_core.comm.paths``; this class routes each call to them.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from zero_core.comm.guard import Call, CollectiveGuard
from zero_core.comm.plain_exchange import all_gather_json
from zero_core.comm import gloo as gloo_paths
from zero_core.comm import paths as comm_paths
from zero_core.comm.topology import Topology

_reduce_scatter = comm_paths.reduce_scatter_into
_all_gather = comm_paths.all_gather_into

# Work handles of the latest collectives stay referenced here (see Communicator._run). gloo's worker thread
# drops its own reference to a work just after completing it; if that is the last reference, it frees the
# work's tensors there, which takes the GIL to release their Python objects. Near interpreter exit that thread
# finds Python finalising and the process aborts ("terminate called without an active exception"). Kept here,
# a recent work is freed by Python's own thread; by the time 8 later ones have completed, gloo's few worker
# threads (2 by default) have long let go of it. The cost: at most 8 collectives' tensors stay alive, mostly
# views of buffers the engine keeps anyway.
_RETAINED_WORKS = 8


@dataclass(frozen=True)
class CommOptions:
    """Which ZeRO++/MiCS paths the collectives take (read from the config by the engine)."""

    quantize_weights: bool = False  # qwZ: int8 blockwise in the forward all-gather of parameters
    quantize_frozen_weights: bool = False  # the same for units without gradients, in every hooked gather
    quantize_gradients: bool = False  # qgZ: hierarchical all-to-all with int4 blockwise on the wire
    hierarchical_gather: bool = False  # MiCS: all-gather across nodes, then inside each node

    @classmethod
    def from_config(cls, config) -> "CommOptions":
        return cls(quantize_weights=config.zero_quantized_weights,
                   quantize_frozen_weights=config.zero_quantized_nontrainable_weights,
                   quantize_gradients=config.zero_quantized_gradients,
                   hierarchical_gather=config.mics_hierarchical_params_gather)


_EMPTY = {"calls": 0, "elements": 0, "bytes": 0, "in_node_bytes": 0, "cross_node_bytes": 0}


class Communicator:
    """Collectives over one topology's shard group, with per-collective counters."""

    def __init__(self, topology: Topology, options: CommOptions = CommOptions()) -> None:
        self.topology = topology
        self.options = options
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: dict(_EMPTY))
        # Debug mode (docs/reliability.md): before each collective, every rank shows what it is about to call, so a
        # mismatch becomes an error naming both sides instead of a hang. Stage 3 also turns it on while it
        # records its first trace.
        self.always_check = os.environ.get("ZERO_CORE_CHECK_COLLECTIVES", "0") == "1"
        self.check = self.always_check
        # Always on (``CollectiveGuard``): a fingerprint per call, a step barrier and a stall watchdog.
        self.guard = CollectiveGuard(topology)
        self._recent_works: deque = deque(maxlen=_RETAINED_WORKS)  # see _RETAINED_WORKS
        self._peers: dict = {}  # group -> (in-node peers, cross-node peers) of this rank
        self._backends: dict = {}  # group -> its backend's name (reduce_scatter_in_place)
        self.paths = comm_paths.Paths(self)
        self._shard_group_only = False
        # No ZeRO++ gather path is configured: every stage-3 gather is plain (the hot path asks per unit).
        self._all_gathers_plain = not (options.quantize_weights or options.quantize_frozen_weights
                                       or topology.secondary_group is not None or self.paths.hierarchical(None))
        self._transport: Optional[tuple] = None  # (reduce-scatter, all-gather) over the shard group; see _plain

    def gathers_alone(self, numel: int) -> bool:
        """Whether stage 3 should all-gather a unit of ``numel`` elements in a collective of its own, straight into
        place, rather than coalesced with others (their shards copied into one buffer and the result out of it).
        Over gloo's all-to-all (gloo.py), for units of at least ``gloo.ALONE_NUMEL`` elements: there a
        collective's fixed cost is small next to copying such a unit twice, and the first unit's gather
        finishes while the later ones are still in flight. Smaller units, and every unit elsewhere, coalesce."""
        return numel >= gloo_paths.ALONE_NUMEL and self._plain()[1] is gloo_paths.all_gather_into

    def _reduce_scatter_plain(self, output, input, group, async_op: bool, scratch: Optional[torch.Tensor]):
        reduce_scatter = self._plain()[0]
        if reduce_scatter is gloo_paths.reduce_scatter_into:
            fits = scratch is not None and scratch.numel() >= input.numel()
            return reduce_scatter(output, input, group=group, async_op=async_op, scratch=scratch if fits else None)
        return reduce_scatter(output, input, group=group, async_op=async_op)

    def _plain(self) -> tuple:
        """The shard group's plain reduce-scatter and all-gather: on gloo through one all-to-all each (gloo.py),
        unless ``ZERO_CORE_GLOO_ALL_TO_ALL=0``; else torch's."""
        if self._transport is None:
            routed = os.environ.get("ZERO_CORE_GLOO_ALL_TO_ALL", "1") != "0" and gloo_paths.applies(self.topology.group)
            self._transport = ((gloo_paths.reduce_scatter_into, gloo_paths.all_gather_into) if routed
                               else (_reduce_scatter, _all_gather))
        return self._transport

    @property
    def replicated(self) -> bool:
        """MiCS replicas take part in this rank's collectives (not inside :meth:`shard_group_only`)."""
        return self.topology.replicas > 1 and not self._shard_group_only

    @contextlib.contextmanager
    def shard_group_only(self):
        """Collectives stay inside the shard group (MiCS: one replica saves a checkpoint alone)."""
        self._shard_group_only = True
        try:
            yield
        finally:
            self._shard_group_only = False

    def _verify(self, name: str, tensor: torch.Tensor, label: str) -> None:
        mine = [name, tensor.numel(), str(tensor.dtype), label]  # a list: what JSON gives back
        everyone = all_gather_json(mine, self.topology.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(
                    f"collective mismatch: rank {self.topology.rank} calls {name} of {mine[1]} {mine[2]} elements "
                    f"for '{label}', but rank {rank} calls {theirs[0]} of {theirs[1]} {theirs[2]} elements for "
                    f"'{theirs[3]}'. Every rank must run the same modules in the same order."
                )

    def _count(self, name: str, tensor: torch.Tensor, label: str = "", wire_bytes: Optional[int] = None) -> Optional[Call]:
        if self.check:
            self._verify(name, tensor, label)
        entry = self._stats[name]
        entry["calls"] += 1
        entry["elements"] += tensor.numel()
        entry["bytes"] += tensor.numel() * tensor.element_size() if wire_bytes is None else wire_bytes
        return self.guard.record(name, tensor.numel(), tensor.dtype, label)

    # -- link classes ------------------------------------------------------------------------------------------
    def _peer_counts(self, group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
        counts = self._peers.get(group)
        if counts is None:
            node_of = self.topology.node_of
            members = dist.get_process_group_ranks(group or dist.group.WORLD)
            me = dist.get_rank()
            others = [m for m in members if m != me]
            cross = sum(1 for m in others if node_of.get(m, 0) != node_of.get(me, 0))
            counts = self._peers[group] = (len(others) - cross, cross)
        return counts

    def count_link(self, name: str, group: Optional[dist.ProcessGroup], per_peer_bytes: int) -> None:
        """This rank sends ``per_peer_bytes`` to every other member of ``group``: add them by link class."""
        in_node, cross = self._peer_counts(group)
        entry = self._stats[name]
        entry["in_node_bytes"] += in_node * per_peer_bytes
        entry["cross_node_bytes"] += cross * per_peer_bytes

    def group_size(self, group: Optional[dist.ProcessGroup]) -> int:
        return dist.get_world_size(group)

    # -- issuing ---------------------------------------------------------------------------------------------
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

    def run(self, call: Optional[Call], launch) -> None:
        """One hop of a composite collective, waited for at once."""
        self._issue(call, False, launch)

    # -- the collectives -------------------------------------------------------------------------------------
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "",
        segments: Optional[Sequence[int]] = None, scratch: Optional[torch.Tensor] = None,
    ) -> Optional[dist.Work]:
        """Sum ``input`` over ranks; this rank receives its equal slice in ``output`` (gradients: with MiCS the
        sum also runs over the replicas, and averages over them; with qgZ it is the quantised all-to-all, whose
        int4 blocks stay inside each of ``segments``, the widths of the slice's parameter units). ``scratch``: a
        free buffer of at least ``input``'s size that gloo's all-to-all (gloo.py) may receive into, until the
        collective is waited on."""
        if self.options.quantize_gradients and input.is_floating_point() and self.topology.world_size > 1:
            return self.paths.quantized_reduce_scatter(output, input, label, async_op, segments)
        group = self.topology.group
        call = self._count("reduce_scatter", input, label)
        self.count_link("reduce_scatter", group, output.numel() * output.element_size())
        work = self._issue(call, async_op and not self.replicated,
                           lambda a: self._reduce_scatter_plain(output, input, group, a, scratch))
        if self.replicated:
            self.paths.average_over_replicas(output, label)
            return comm_paths.DONE if async_op else None
        return work

    def reduce_scatter_in_place(self, input: torch.Tensor, async_op: bool = False, label: str = "") -> Optional[dist.Work]:
        """:meth:`reduce_scatter` of ``input`` into this rank's own slice of it (``input.chunk(n)[rank]``), the
        caller letting the other slices be overwritten; counted as the reduce-scatter it is. gloo implements a
        reduce-scatter as a clone of the whole input (freshly allocated at every call), an all-reduce of the
        clone and a copy of the slice out: here that all-reduce runs on ``input`` itself, the same traffic at
        any world size without the clone or the copy. Other backends reduce-scatter into the slice."""
        group = self.topology.group
        if self.replicated or self.options.quantize_gradients or not self._gloo(group):
            shard = input.numel() // self.topology.world_size
            own = input[self.topology.rank * shard : (self.topology.rank + 1) * shard]
            return self.reduce_scatter(own, input, async_op=async_op, label=label)
        call = self._count("reduce_scatter", input, label)
        self.count_link("reduce_scatter", group, input.numel() // self.topology.world_size * input.element_size())
        return self._issue(call, async_op, lambda a: dist.all_reduce(input, group=group, async_op=a))

    def all_gather_in_place(self, output: torch.Tensor, async_op: bool = False, label: str = "") -> Optional[dist.Work]:
        """:meth:`all_gather` of this rank's own slice of ``output`` (``output.chunk(n)[rank]``) into ``output``;
        counted as that all-gather. gloo has no in-place all-gather (it gathers into a temporary as big as
        ``output`` and copies it out), so there, at any world size, each rank's slice is broadcast in place
        (gloo.py's all-gather, the one stage 3 takes on gloo). Other backends all-gather in place."""
        group, world, rank = self.topology.group, self.topology.world_size, self.topology.rank
        shard = output.numel() // world
        own = output[rank * shard : (rank + 1) * shard]
        if self.replicated or not self._gloo(group):
            return self.all_gather(output, own, async_op=async_op, label=label)
        call = self._count("all_gather", output, label)
        self.count_link("all_gather", group, shard * output.element_size())
        return self._issue(call, async_op, lambda a: gloo_paths.all_gather_into(output, own, group=group, async_op=a))

    def _gloo(self, group: Optional[dist.ProcessGroup]) -> bool:
        backend = self._backends.get(group)
        if backend is None:
            backend = self._backends[group] = dist.get_backend(group)
        return backend == "gloo"

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "",
        phase: Optional[str] = None, key: Optional[object] = None, frozen: bool = False,
    ) -> Optional[dist.Work]:
        """Concatenate every rank's ``input`` into ``output`` in rank order.

        Stage 3's hooks say which ``phase`` ("forward" or "backward") a parameter gather serves and give a
        ``key`` per gathered buffer: qwZ quantises forward gathers (and, for ``frozen`` units with
        ``zero_quantized_nontrainable_weights``, every hooked gather); hpZ keeps this rank's slice of the
        forward result inside its node and serves the backward's gather from there."""
        paths = self.paths
        if phase == "backward" and paths.has_secondary(key):
            return paths.gather_secondary(output, key, label, async_op)
        quantized = input.is_floating_point() and (
            (phase == "forward" and self.options.quantize_weights)
            or (phase is not None and frozen and self.options.quantize_frozen_weights))
        if quantized or paths.hierarchical(phase) or (phase == "forward" and paths.keeps_secondary(key)):
            return paths.gather(output, input, label, async_op, quantized, phase, key)
        group = self.topology.group
        call = self._count("all_gather", output, label)
        self.count_link("all_gather", group, input.numel() * input.element_size())
        return self._issue(call, async_op, lambda a: self._plain()[1](output, input, group=group, async_op=a))

    def all_gather_packed(
        self, output: torch.Tensor, packed: "comm_paths.Quantized", numel: int, async_op: bool = False,
        label: str = "", phase: Optional[str] = None, key: Optional[object] = None,
    ) -> Optional[dist.Work]:
        """:meth:`all_gather` of a shard stored quantised (``zero_quantized_nontrainable_weights``): its codes go
        on the wire as they are and every rank's are dequantised into ``output``, in every phase."""
        if phase == "backward" and self.paths.has_secondary(key):
            return self.paths.gather_secondary(output, key, label, async_op)
        return self.paths.gather_packed(output, packed, numel, label, async_op, phase, key)

    def plain_gather(self, phase: Optional[str], frozen: bool = False) -> bool:
        """Whether a stage-3 parameter gather in ``phase`` is one plain all-gather over the shard group (no ZeRO++
        path): only those may be coalesced across units (param_unit.gather_together)."""
        if self._all_gathers_plain:
            return True
        if self.paths.hierarchical(phase):
            return False
        if phase is None:
            return True
        if self.topology.secondary_group is not None:
            return False  # hpZ keeps, then serves, each gathered buffer's in-node slice
        quantized = (phase == "forward" and self.options.quantize_weights) or (
            frozen and self.options.quantize_frozen_weights)
        return not quantized

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
        over: str = "shard",
    ) -> Optional[dist.Work]:
        """All-reduce over the shard group (``over="shard"``: norms of shards, which replicas hold alike); over
        every rank (``"world"``: flags); or ``"gradients"``: over every rank, averaged over the MiCS replicas
        (the caller divided by the shard group's size)."""
        group = self.topology.group
        call = self._count("all_reduce", tensor)
        size = self.group_size(group)
        self.count_link("all_reduce", group, 2 * tensor.numel() * tensor.element_size() // max(size, 1))
        if over == "shard" or not self.replicated:
            return self._issue(call, async_op, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a))
        self.run(call, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a))
        self.paths.reduce_over_replicas(tensor, op, average=over == "gradients")
        return comm_paths.DONE if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[dist.Work]:
        """Broadcast from shard-group rank ``src`` (with MiCS: then from the first replica to the others, so
        every rank starts from global rank ``src``'s values, as with DDP)."""
        group = self.topology.group
        call = self._count("broadcast", tensor)
        if self.topology.rank == src:
            self.count_link("broadcast", group, tensor.numel() * tensor.element_size())
        root = self.topology.global_rank(src)
        if not self.replicated:
            return self._issue(call, async_op, lambda a: dist.broadcast(tensor, src=root, group=group, async_op=a))
        self.run(call, lambda a: dist.broadcast(tensor, src=root, group=group, async_op=a))
        self.paths.broadcast_over_replicas(tensor)
        return comm_paths.DONE if async_op else None

    def scatter(self, output: torch.Tensor, inputs: Optional[list[torch.Tensor]], src: int, label: str = "") -> None:
        """Shard-group rank ``src`` sends ``inputs[r]`` to rank ``r``'s ``output`` (each of ``output``'s size;
        ``inputs`` only on ``src``): pretrained weights read by one rank (pretrained/into_shards.py). Counted as
        the whole it covers, every rank's ``output``."""
        if self.replicated:
            raise RuntimeError("Communicator.scatter covers one shard group: MiCS replicas (mics_shard_size) "
                               "would each need their own reader; read the weights on every rank (rank0_reads=False)")
        group, world = self.topology.group, self.topology.world_size
        call = self._count("scatter", output, label, wire_bytes=output.numel() * output.element_size() * world)
        self._stats["scatter"]["elements"] += output.numel() * (world - 1)
        if self.topology.rank == src:
            self.count_link("scatter", group, output.numel() * output.element_size())
        root = self.topology.global_rank(src)
        self._issue(call, False, lambda a: dist.scatter(output, inputs, src=root, group=group, async_op=a))

    def barrier_world(self) -> None:
        """Every rank of the data-parallel world (MiCS replicas included) reaches this point."""
        flag = torch.zeros(1, device=self.guard_device())
        self.all_reduce(flag, over="world")

    def guard_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def forget_secondary(self) -> None:
        """Parameters changed (a step, a load): hpZ's in-node copies are stale until the next forward."""
        self.paths.forget_secondary()

    def stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements, bytes and bytes sent per link class, per collective since the last reset."""
        return {name: dict(entry) for name, entry in self._stats.items()}

    def link_bytes(self) -> dict[str, int]:
        """Bytes this rank sent to ranks on its own node and on other nodes, over every collective."""
        return {"in_node": sum(e["in_node_bytes"] for e in self._stats.values()),
                "cross_node": sum(e["cross_node_bytes"] for e in self._stats.values())}

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
