"""``offload_param: {device: cpu}`` at stage 3: each unit's parameter shard lives in host memory (pinned with
``pin_memory`` when CUDA exists) and is copied to the accelerator just before its all-gather (ParamUnit.gather),
then dropped once the gather is done. Gradient shards stay on the accelerator. ``device: nvme`` is not
implemented yet and is refused in setup.
"""

from __future__ import annotations

import torch

from ..master_shards import MasterShards
from .placement import host_copy, pinning


def offload_param_shards(units: list, config) -> None:
    """Move the shard of every stage 3 unit in ``units`` to host memory; fp32 masters that were views of it
    follow it (frozen units have none)."""
    block = config.offload_param
    if block is None or block.device == "none" or not units:
        return
    if block.device == "nvme":
        raise ValueError(
            "zero_optimization.offload_param.device 'nvme' is not implemented yet: use 'cpu' (parameter shards in "
            "host memory), and offload_optimizer.device 'nvme' for the optimizer state"
        )
    pin = pinning(block.pin_memory)
    for unit in units:
        old = unit.shard
        if old.device.type == "cpu" and old.is_pinned() == pin and getattr(unit, "_host_shard", False):
            continue  # already offloaded
        unit.shard = host_copy(old, old.dtype, pin)
        unit._host_shard = True
        masters = unit.master_shards
        if masters is not None and any(_aliases(b, old) for b in masters.buckets):
            # An fp32 master is the shard itself (MasterShards): rebuild it over the host shard.
            unit.master_shards = MasterShards(unit.layout, unit.rank, unit._shard_buckets(), torch.float32)


def _aliases(master, shard) -> bool:
    return master.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
