"""The process groups an engine works over.

Today the shard group is the whole data-parallel world. Hierarchical partitioning (hpZ, MiCS) will add a
smaller shard group and a replicate group here, and nothing above this layer needs to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """This rank's place in the data-parallel world."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int

    @classmethod
    def from_process_group(cls, group: Optional[dist.ProcessGroup] = None) -> "Topology":
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_core needs torch.distributed to be initialized before setup(): call "
                "torch.distributed.init_process_group(backend=...) first, or launch with torchrun, "
                "Lightning or accelerate launch (a single process works too, with world_size=1)."
            )
        return cls(group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in the shard group (what broadcast's ``src`` expects)."""
        return dist.get_global_rank(self.group or dist.group.WORLD, group_rank)
