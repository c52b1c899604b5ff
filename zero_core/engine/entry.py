"""``zero_core.setup``: check the arguments, resolve the config, build the topology, build the engine."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from zero_core import checkpointing
from zero_core.arg_checks import check_module, check_process_group
from zero_core.comm.topology import Topology
from zero_core.config import ZeroConfig
from zero_core.engine.binding import as_optimizer_list
from zero_core.engine.facade import ConfigLike, ZeroEngine


def setup(
    model: nn.Module,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
    config: ConfigLike = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> ZeroEngine:
    """Put ``model`` and ``optimizer`` under ZeRO; ``config`` is a ZeroConfig, a dict, a JSON/YAML path or None.

    ``optimizer`` may be a list: each optimizer then steps, clips and zeroes only its own parameters
    (``engine.optimizers[k]``), e.g. a generator's and a discriminator's."""
    check_module(model, "zero_core.setup", "model",
                 "Pass the model first, then its optimizer: zero_core.setup(model, optimizer, config)")
    optimizers = as_optimizer_list(optimizer)
    check_process_group(process_group, "zero_core.setup", "process_group")
    config = ZeroConfig.coerce(config, "zero_core.setup: config")
    if config.auto_fields:
        config = config.resolve_auto()  # front-ends resolve "auto" from their run first; the rest is reported
    if config.stage == 0:
        raise ValueError(
            "zero_optimization.stage=0 disables ZeRO: use torch's DistributedDataParallel, or pick stage 1, 2 or 3"
        )
    config.warn_unimplemented()
    if checkpointing.configure(deepspeed_config=config).active:  # the activation_checkpointing block
        checkpointing.route_hf_checkpointing(model)
    topology = Topology.from_process_group(process_group, mics_shard_size=config.mics_shard_size,
                                           hpz_partition_size=config.zero_hpz_partition_size,
                                           hierarchical_gather=config.mics_hierarchical_params_gather)
    return ZeroEngine(model, optimizers, config, topology)
