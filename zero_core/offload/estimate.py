"""Where an estimate's bytes live under the config's offload settings: accelerator, host memory, NVMe file
(``zero-estimate`` prints it; docs/offload.md has the same table as formulas)."""

from __future__ import annotations

from dataclasses import dataclass

from zero_core.config import ZeroConfig
from zero_core.offload.nvme_swap import NVME_TILE_NUMEL

MASTER_BYTES = 4  # an offloaded master is always its own fp32 host copy
HOST_GRAD_BYTES = 4  # the fp32 host gradient buffer the CPU step reads (torch's fused kernel)
TILES_IN_FLIGHT = 3  # NVMe: the tile stepping, the next being read, the last being written (during the step only)


@dataclass(frozen=True)
class Placement:
    accelerator: int
    host: int
    nvme: int


def placement_bytes(estimate, config) -> Placement:
    """Split ``estimate`` (a MemoryEstimate) by place for ``config``'s offload_optimizer / offload_param."""
    cfg = ZeroConfig.coerce(config)
    shard = estimate.shard_numel
    accelerator, host, nvme = estimate.total, 0, 0
    optimizer = cfg.offload_optimizer.device if cfg.offload_optimizer else "none"
    if optimizer != "none":
        accelerator -= estimate.fp32_master + estimate.optimizer_state
        # the step runs on the host: its fp32 tile (MemoryEstimate.step_tile) is the host gradient buffer below
        accelerator -= max(estimate.live_params, estimate.step_tile) - estimate.live_params
        moved = MASTER_BYTES * shard + estimate.optimizer_state  # master + state, per element (4 + K)
        if estimate.stage >= 2:
            # a reduced gradient shard gives its accelerator memory back once its copy to the host (cpu) or to the
            # swap file (nvme, nvme_grads.py) is under way (grad_memory.MovedToHost, on CUDA): the one in flight
            # is a unit's or a bucket's, and stage 2's bucket reduced last is the reducer's kept staging (counted
            # in its buffers), not counted
            accelerator -= estimate.grads
        if optimizer == "cpu":
            compiled = cfg.offload_optimizer.host_kernel == "compiled" and estimate.precision != "fp32"
            host += moved + (2 if compiled else HOST_GRAD_BYTES) * shard  # compiled: 16-bit buffers (compiled_adam.py)
        else:
            nvme += moved + (estimate.grads if estimate.stage >= 2 else 0)  # the gradients' regions of the file
            tile = min(cfg.sub_group_size, NVME_TILE_NUMEL, shard)
            per_element = moved / shard if shard else 0
            host += int((TILES_IN_FLIGHT + cfg.offload_optimizer.buffer_count) * tile * per_element)
            host += 2 * HOST_GRAD_BYTES * tile  # the tile's gradients, and the next tile's read ahead from the file
    param_device = cfg.offload_param.device if cfg.offload_param else "none"
    if estimate.stage == 3 and param_device != "none":
        param_shard = _param_shard_bytes(estimate)
        accelerator -= param_shard
        if param_device == "cpu":
            host += param_shard
        else:  # max_in_cpu elements stay in host memory; buffer_count buffers of buffer_size elements read the rest
            block = cfg.offload_param
            element = param_shard // shard if shard else 0
            in_cpu = min(block.max_in_cpu, shard) * element
            host += in_cpu + block.buffer_count * min(block.buffer_size, shard) * element
            nvme += param_shard - in_cpu
    return Placement(accelerator=accelerator, host=host, nvme=nvme)


def _param_shard_bytes(estimate) -> int:
    """Stage 3's trainable parameter shard in the training dtype (persistent and frozen parameters aside)."""
    element = 4 if estimate.precision == "fp32" else 2
    return estimate.shard_numel * element
