"""``offload_param: {device: cpu}`` at stage 3: each unit's parameter shard lives in host memory (pinned with
``pin_memory`` when CUDA exists) and is copied to the accelerator just before its all-gather (ParamUnit.gather),
then dropped once the gather is done. Gradient shards stay on the accelerator. ``device: nvme`` is not
implemented yet and is refused in setup.
"""

from __future__ import annotations

from torch import nn

from .placement import host_copy, pinning


def offload_param_shards(runtime, config) -> None:
    """Move every stage 3 unit's shard to host memory; fp32 masters that were views of it follow it."""
    block = config.offload_param
    if block is None or block.device == "none":
        return
    if block.device == "nvme":
        raise ValueError(
            "zero_optimization.offload_param.device 'nvme' is not implemented yet: use 'cpu' (parameter shards in "
            "host memory), and offload_optimizer.device 'nvme' for the optimizer state"
        )
    pin = pinning(block.pin_memory)
    for unit in runtime.units:
        old = unit.shard
        unit.shard = host_copy(old, old.dtype, pin)
        # An fp32 master is the shard itself (make_masters): re-point it at the host shard.
        unit.masters = [nn.Parameter(unit._bucket_shard(unit.shard, b.index)) if _aliases(m, old) else m
                        for m, b in zip(unit.masters, unit.layout.buckets)]


def _aliases(master, shard) -> bool:
    return master.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
