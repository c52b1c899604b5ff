"""The multi-hop collectives behind the Communicator: ZeRO++ (qwZ, qgZ, hpZ) and MiCS (docs/multinode.md).

Each is one logical collective (counted once in its kind's calls and elements, with the wire format's bytes)
made of hops over the topology's groups; every hop's sends are counted per link class. Hops are waited for in
turn, so these paths are synchronous: an async caller gets ``DONE``. Reductions of quantised data happen in
fp32 after dequantising (never on the codes).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from zero_core.comm import quantize as _quantize
from zero_core.comm.quantize import Quantized, wire_bytes

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the first names.
reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Done:
    """The handle of a collective that already completed."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class Paths:
    """ZeRO++ and MiCS collectives of one Communicator, and hpZ's in-node parameter copies."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.topology = comm.topology
        self._secondary: dict = {}  # hpZ: gathered-buffer key -> this rank's in-node slice of its last forward
        self.codec_seconds = 0.0  # CPU time spent quantising and dequantising (benchmarks/nodes.py reports it)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.codec_seconds += time.perf_counter() - start

    # -- hpZ ----------------------------------------------------------------------------------------------
    def keeps_secondary(self, key) -> bool:
        return key is not None and self.topology.secondary_group is not None

    def has_secondary(self, key) -> bool:
        return key is not None and key in self._secondary

    def forget_secondary(self) -> None:
        self._secondary.clear()

    def secondary_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._secondary.values())

    def _keep_secondary(self, output: torch.Tensor, key) -> None:
        size = self.topology.secondary_size
        self._secondary[key] = output.view(size, -1)[self.topology.rank % size].clone()

    def gather_secondary(self, output: torch.Tensor, key, label: str, async_op: bool):
        """The backward's gather from the in-node copy: no byte crosses nodes."""
        piece, group = self._secondary[key], self.topology.secondary_group
        call = self.comm._count("all_gather", output, label)
        self.comm.count_link("all_gather", group, piece.numel() * piece.element_size())
        self.comm.run(call, lambda a: all_gather_into(output, piece, group=group, async_op=a))
        return DONE if async_op else None

    # -- qwZ and hierarchical gathers ---------------------------------------------------------------------
    def hierarchical(self, phase: Optional[str]) -> bool:
        return self.comm.options.hierarchical_gather and self.topology.gather_route is not None

    def gather(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool, quantized: bool,
               phase: Optional[str], key):
        """All-gather, 8-bit-quantised when ``quantized`` (dequantised into ``output``), flat or hierarchical."""
        if quantized:
            packed = self._timed(_quantize.quantize, input.reshape(1, -1), 8, _quantize.BLOCK, None, True)
            return self.gather_packed(output, packed, input.numel(), label, async_op, phase, key)
        call = self.comm._count("all_gather", output, label)
        self._route(output, input, call)
        self._after_gather(output, phase, key)
        return DONE if async_op else None

    def gather_packed(self, output: torch.Tensor, packed: Quantized, numel: int, label: str, async_op: bool,
                      phase: Optional[str], key):
        """All-gather this rank's ``numel`` elements already quantised (asymmetric 8 bits, one row: qwZ's wire
        format, or a frozen unit's stored shard) and dequantise every rank's into ``output``."""
        world = self.topology.world_size
        call = self.comm._count("all_gather", output, label, wire_bytes=wire_bytes(world, numel, 8, asymmetric=True))
        codes = torch.empty(world, packed.codes.shape[1], dtype=packed.codes.dtype, device=output.device)
        # each block's scale and minimum travel together: one fp32 gather
        ranges = torch.empty(world, 2 * packed.scales.shape[1], dtype=torch.float32, device=output.device)
        self._route(codes, packed.codes.reshape(-1).to(output.device), call)
        self._route(ranges, torch.cat((packed.scales, packed.offsets), dim=1).reshape(-1).to(output.device), call)
        scales, offsets = ranges.chunk(2, dim=1)
        output.view(world, numel).copy_(self._timed(_quantize.dequantize, Quantized(codes, scales, offsets), 8, numel))
        self._after_gather(output, phase, key)
        return DONE if async_op else None

    def _after_gather(self, output: torch.Tensor, phase: Optional[str], key) -> None:
        if phase == "forward" and self.keeps_secondary(key):
            self._keep_secondary(output, key)

    def _route(self, output: torch.Tensor, input: torch.Tensor, call) -> None:
        """Gather over the shard group: in one hop, or across nodes first and then inside each node."""
        comm, size = self.comm, input.numel() * input.element_size()
        route = self.topology.gather_route if self.comm.options.hierarchical_gather else None
        if route is None:
            group = self.topology.group
            comm.count_link("all_gather", group, size)
            comm.run(call, lambda a: all_gather_into(output.reshape(-1), input, group=group, async_op=a))
            return
        cross, local, nodes, per_node = route
        across = torch.empty(nodes * input.numel(), dtype=input.dtype, device=input.device)
        comm.count_link("all_gather", cross, size)
        comm.run(call, lambda a: all_gather_into(across, input, group=cross, async_op=a))
        within = torch.empty(per_node, nodes * input.numel(), dtype=input.dtype, device=input.device)
        comm.count_link("all_gather", local, size * nodes)
        comm.run(call, lambda a: all_gather_into(within.view(-1), across, group=local, async_op=a))
        # within[l, j] is the shard of the j-th node's l-th rank, whose shard-group rank is j * per_node + l
        output.reshape(nodes, per_node, -1).copy_(within.view(per_node, nodes, -1).transpose(0, 1))

    # -- qgZ ---------------------------------------------------------------------------------------------
    def quantized_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool):
        """Sum ``input`` over ranks into this rank's slice, through an all-to-all inside the node and then one
        across nodes, each sending int4 codes with per-block scales (rounded to nearest); partial sums are fp32."""
        topology, numel = self.topology, output.numel()
        mesh = topology.mesh
        nodes, per_node = (mesh.size(0), mesh.size(1)) if mesh is not None else (1, topology.world_size)
        local = topology.local_group() if mesh is not None else topology.group
        call = self.comm._count("reduce_scatter", input, label,
                                wire_bytes=wire_bytes(topology.world_size, numel, 4, _quantize.GRAD_BLOCK))
        # row l: the slices of every node's l-th rank, sent to this node's l-th rank
        rows = input.view(nodes, per_node, numel).transpose(0, 1).reshape(per_node, nodes * numel)
        partial = self._all_to_all_sum(rows, local, call).view(nodes, numel)
        total = self._all_to_all_sum(partial, topology.cross_group(), call) if nodes > 1 else partial[0]
        output.copy_(total.view_as(output))
        return DONE if async_op else None

    def _all_to_all_sum(self, rows: torch.Tensor, group, call) -> torch.Tensor:
        """Row i goes to member i (int4 on the wire); the rows received are summed in fp32."""
        packed = self._timed(_quantize.quantize, rows, 4, _quantize.GRAD_BLOCK)
        codes, scales = torch.empty_like(packed.codes), torch.empty_like(packed.scales)
        self.comm.count_link("reduce_scatter", group, packed.codes[0].numel() + packed.scales[0].numel() * 4)
        self.comm.run(call, lambda a: dist.all_to_all_single(codes, packed.codes, group=group, async_op=a))
        self.comm.run(call, lambda a: dist.all_to_all_single(scales, packed.scales, group=group, async_op=a))
        return self._timed(_quantize.dequantize, Quantized(codes, scales), 4, rows.shape[1], _quantize.GRAD_BLOCK).sum(0)

    # -- MiCS replicas -----------------------------------------------------------------------------------
    def average_over_replicas(self, tensor: torch.Tensor, label: str) -> None:
        """After the shard group's reduce-scatter: sum the shard over the replicas, and average."""
        self.reduce_over_replicas(tensor, dist.ReduceOp.SUM, average=True, label=label)

    def reduce_over_replicas(self, tensor: torch.Tensor, op, average: bool, label: str = "") -> None:
        group, replicas = self.topology.replicate_group, self.topology.replicas
        call = self.comm._count("all_reduce", tensor, label)
        self.comm.count_link("all_reduce", group, 2 * tensor.numel() * tensor.element_size() // replicas)
        self.comm.run(call, lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a))
        if average:
            tensor.div_(replicas)

    def broadcast_over_replicas(self, tensor: torch.Tensor) -> None:
        group = self.topology.replicate_group
        call = self.comm._count("broadcast", tensor)
        if self.topology.replica_index == 0:
            self.comm.count_link("broadcast", group, tensor.numel() * tensor.element_size())
        root = dist.get_global_rank(group, 0)
        self.comm.run(call, lambda a: dist.broadcast(tensor, src=root, group=group, async_op=a))
