"""``offload_param`` at stage 3: each unit's parameter shard leaves the accelerator.

- ``device: cpu``: the shard lives in host memory (pinned with ``pin_memory`` when CUDA exists) and is copied to
  the accelerator just before its all-gather (ParamUnit.gather), then dropped once the gather is done.
- ``device: nvme``: the first ``max_in_cpu`` elements of shards (units in model order) stay in host memory as
  with ``cpu``; the others are written to a per-rank file and read into a pool buffer for each gather
  (param_swap.py).
Gradient shards stay on the accelerator.
"""

from __future__ import annotations

import torch

from zero_core.optim.master_shards import MasterShards
from zero_core.offload.param_swap import ParamSwap
from zero_core.offload.placement import host_copy, pinning


def offload_param_shards(runtime, units: list, config, rank: int) -> None:
    """Move the shard of every stage 3 unit in ``units`` not offloaded yet off the accelerator; fp32 masters
    that were views of it follow it (frozen units have none)."""
    block = config.offload_param
    units = [u for u in units if not u.offloaded]
    if block is None or block.device == "none" or not units:
        return
    pin = pinning(block.pin_memory)
    in_cpu = runtime.param_elements_in_cpu
    to_file = []
    for unit in units:
        unit.offloaded = True
        old = unit.shard
        if block.device == "nvme" and in_cpu + old.numel() > block.max_in_cpu:
            # A master that was the shard itself keeps the shard's memory as its own (the shard moves to the
            # file): no copy, and so no second copy of every such unit while setup offloads them all.
            to_file.append(unit)
            continue
        in_cpu += old.numel()
        unit.shard = host_copy(old, old.dtype, pin)
        if _master_aliases(unit, old):  # rebuild the master over the host shard, in the dtype it had (views of
            # the shard where offload_optimizer makes the fp32 masters next: no fp32 copy in between)
            dtype = unit.master_shards.buckets[0].dtype
            unit.master_shards = MasterShards(unit.layout, unit.rank, unit.param_shards(), dtype)
    runtime.param_elements_in_cpu = in_cpu
    if not to_file:
        return
    swap = runtime.param_swap
    if swap is None:
        swap = runtime.param_swap = ParamSwap(block, config.aio, rank, [u.shard for u in to_file])
    for unit in to_file:
        swap.adopt(unit)


def _master_aliases(unit, shard: torch.Tensor) -> bool:
    masters = unit.master_shards
    return masters is not None and any(
        b.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr() for b in masters.buckets)
