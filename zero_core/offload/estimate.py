"""Where an estimate's bytes live under the config's offload settings: accelerator, host memory, NVMe file
(``zero-estimate`` prints it; docs/offload.md has the same table as formulas)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig

MASTER_BYTES = 4  # an offloaded master is always its own fp32 host copy
HOST_GRAD_BYTES = 4  # the fp32 host gradient buffer the CPU step reads
TILES_IN_FLIGHT = 3  # NVMe: the tile stepping, the next being read, the last being written


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
        moved = MASTER_BYTES * shard + estimate.optimizer_state  # master + state, per element (4 + K)
        if optimizer == "cpu":
            host += moved + HOST_GRAD_BYTES * shard
        else:
            nvme += moved
            tile = min(cfg.sub_group_size, shard)
            per_element = moved / shard if shard else 0
            host += int((TILES_IN_FLIGHT + cfg.offload_optimizer.buffer_count) * tile * per_element)
            host += HOST_GRAD_BYTES * tile
    if estimate.stage == 3 and cfg.offload_param and cfg.offload_param.device == "cpu":
        param_shard = _param_shard_bytes(estimate)
        accelerator -= param_shard
        host += param_shard
    return Placement(accelerator=accelerator, host=host, nvme=nvme)


def _param_shard_bytes(estimate) -> int:
    """Stage 3's trainable parameter shard in the training dtype (persistent and frozen parameters aside)."""
    element = 4 if estimate.precision == "fp32" else 2
    return estimate.shard_numel * element
