"""The process groups an engine works over, and which node each rank runs on.

- The *shard group* (``group``, ``rank``, ``world_size``) partitions model states: the whole data-parallel
  world, or with MiCS (``mics_shard_size``) a block of that many consecutive ranks. Everything that shards
  (layouts, buckets, units, checkpoints) sees only this group.
- The *replicate group* joins the ranks that hold the same shard in different MiCS groups; gradients are
  all-reduced over it after the reduce-scatter in the shard group (by the ``Communicator``). One member, and ``None``, without MiCS.
- The *secondary group* (hpZ, ``zero_hpz_partition_size``) partitions a second copy of the 16-bit parameters
  inside a node; the backward gathers from it.
- ``node_of`` maps every global rank to its node, read from the launcher's environment, so that the comm layer
  can count bytes per link class (in-node, cross-node). With several nodes of equal size whose ranks are
  numbered node by node (torchrun, Lightning, accelerate and SLURM all number them so), ``mesh`` is a 2-D
  ``DeviceMesh`` (``node`` × ``local``) whose groups carry the hierarchical collectives.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from zero_core.comm.plain_exchange import all_gather_json

# Where launchers put the node index: torchrun (and accelerate launch, which runs it) sets GROUP_RANK,
# Lightning's launcher NODE_RANK, SLURM SLURM_NODEID. Without any, ranks on the same host share a node.
_NODE_ENV = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def node_key() -> str:
    """This process's node, as the launcher tells it."""
    for name in _NODE_ENV:
        if os.environ.get(name, "") != "":
            return f"{name}={os.environ[name]}"
    return f"host={socket.gethostname()}"


@dataclass(frozen=True)
class Topology:
    """This rank's place in the data-parallel world."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    replicate_group: Optional[dist.ProcessGroup] = None
    replicas: int = 1
    replica_index: int = 0
    secondary_group: Optional[dist.ProcessGroup] = None  # hpZ: None when off
    secondary_size: int = 1
    node_of: dict = field(default_factory=dict, compare=False)  # global rank -> node index; empty: all on one node
    mesh: Optional[object] = field(default=None, compare=False)  # DeviceMesh (node, local), when there are several equal nodes
    data_parallel_group: Optional[dist.ProcessGroup] = None  # the whole world the engine trains over
    # MiCS hierarchical gather over a shard group spanning nodes: (same local index in the shard group, this
    # node, nodes in the shard group, ranks per node); None when the shard group is inside one node.
    gather_route: Optional[tuple] = field(default=None, compare=False)

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup] = None, mics_shard_size: int = -1,
                           hpz_partition_size: int = 1, hierarchical_gather: bool = False) -> "Topology":
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_core needs torch.distributed to be initialized before setup(): call "
                "torch.distributed.init_process_group(backend=...) first, or launch with torchrun, "
                "Lightning or accelerate launch (a single process works too, with world_size=1)."
            )
        world = dist.get_world_size(group)
        node_of = _discover_nodes(group, world)
        mesh = _node_mesh(group, node_of)
        base = dict(node_of=node_of, mesh=mesh, data_parallel_group=group)
        if mics_shard_size not in (-1, world) or hpz_partition_size > 1:
            _require_world_group(group, mics_shard_size, hpz_partition_size)
        shard_size = world if mics_shard_size == -1 else mics_shard_size
        if hierarchical_gather and mesh is not None:
            base["gather_route"] = _gather_route(mesh, world, shard_size)
        if shard_size != world:
            return _mics(world, shard_size, base)
        secondary, size = None, 1
        if hpz_partition_size > 1:
            secondary, size = _blocks_of(world, hpz_partition_size, "zero_optimization.zero_hpz_partition_size",
                                         mesh), hpz_partition_size
        return cls(group=group, rank=dist.get_rank(group), world_size=world, secondary_group=secondary,
                   secondary_size=size, **base)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the shard group (what broadcast's ``src`` expects)."""
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of.values())) if self.node_of else 1

    def local_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's node (the mesh's ``local`` dimension); None with one node."""
        return self.mesh.get_group("local") if self.mesh is not None else None

    def cross_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks with this rank's local index on every node (the mesh's ``node`` dimension)."""
        return self.mesh.get_group("node") if self.mesh is not None else None


def _discover_nodes(group, world: int) -> dict:
    """Global rank -> node index. Skips the exchange when the launcher says every rank is on one node."""
    if world == 1 or os.environ.get("LOCAL_WORLD_SIZE") == str(world):
        return {}
    keys = all_gather_json(node_key(), group)
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    node_of = {rank: index[key] for rank, key in zip(ranks, keys)}
    return node_of if len(index) > 1 else {}


def _node_mesh(group, node_of: dict):
    """A (node, local) DeviceMesh over the world, when nodes are equal and numbered node by node."""
    if not node_of or group not in (None, dist.group.WORLD):
        return None
    nodes = len(set(node_of.values()))
    world = len(node_of)
    per_node = world // nodes
    if world % nodes or any(node_of[r] != r // per_node for r in range(world)):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (nodes, per_node), mesh_dim_names=("node", "local"))


def _require_world_group(group, mics: int, hpz: int) -> None:
    if group not in (None, dist.group.WORLD):
        raise ValueError(
            f"mics_shard_size ({mics}) and zero_hpz_partition_size ({hpz}) split the default process group into "
            "blocks of ranks; with a custom process_group passed to setup, leave them at -1 and 1"
        )


def _blocks_of(world: int, size: int, field_name: str, mesh=None):
    """Groups of ``size`` consecutive ranks (every rank creates every group, in the same order); this rank's."""
    if size < 1 or world % size:
        raise ValueError(f"{field_name}={size} must divide the number of ranks ({world}); pick a divisor of "
                         f"{world}, such as the number of ranks per node")
    if mesh is not None and mesh.size(1) == size:
        return mesh.get_group("local")  # the node's own group, already built
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def _mics(world: int, size: int, base: dict) -> Topology:
    """MiCS: shard in blocks of ``size`` consecutive ranks, replicate across blocks (strided groups)."""
    shard = _blocks_of(world, size, "zero_optimization.mics_shard_size")
    rank = dist.get_rank()
    replicate = None
    for offset in range(size):
        group = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            replicate = group
    return Topology(group=shard, rank=rank % size, world_size=size, replicate_group=replicate,
                    replicas=world // size, replica_index=rank // size, **base)


def _gather_route(mesh, world: int, shard_size: int) -> Optional[tuple]:
    """The two groups a hierarchical gather over each shard block uses (every rank creates every group)."""
    nodes, per_node = mesh.size(0), mesh.size(1)
    if shard_size <= per_node:
        return None  # the shard group is inside one node: one hop already stays there
    if shard_size % per_node:
        raise ValueError(f"mics_hierarchical_params_gather needs mics_shard_size ({shard_size}) to be a multiple of "
                         f"the ranks per node ({per_node}); pick whole nodes, or turn the hierarchical gather off")
    if shard_size == world:
        return mesh.get_group("node"), mesh.get_group("local"), nodes, per_node
    rank, mine = dist.get_rank(), None
    for start in range(0, world, shard_size):
        for local in range(per_node):
            group = dist.new_group(list(range(start + local, start + shard_size, per_node)))
            if start <= rank < start + shard_size and rank % per_node == local:
                mine = group
    return mine, mesh.get_group("local"), shard_size // per_node, per_node
