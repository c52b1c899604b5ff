"""The model's whole state dict out of a live engine, one parameter at a time.

``module.state_dict()`` under an engine is not the trained model: at stage 3 parameters are partitioned, and
under 16-bit precision the model holds the 16-bit copy while the fp32 master weights live in the optimizer's
shards. :func:`full_state_dict` gives what ``DistributedDataParallel``'s ``module.state_dict()`` gives: every key
of ``module.state_dict()`` in its order, trainable parameters as their fp32 master values, frozen parameters and
buffers as the model holds them. Memory: each rank holds at most one whole parameter beyond its shards while it
runs; the result (on rank 0 only by default) is a CPU copy, as Lightning's FSDP strategy gives.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

import torch
from torch import nn

from zero_core.contracts import CheckpointedEngine
from zero_core.fragments import whole_value


def state_dict_entries(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) in exactly ``module.state_dict()``'s order, without reading any value (partitioned
    parameters must not be read)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer
    for name, child in module._modules.items():
        if child is not None:
            yield from state_dict_entries(child, f"{prefix}{name}.")


def full_state_dict(engine: CheckpointedEngine, rank0_only: bool = True,
                    exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The whole model state as CPU tensors; ``{}`` on ranks other than 0 when ``rank0_only``. A collective:
    every rank of the engine calls it, at the same point. ``exclude_frozen_parameters``: without the parameters
    the engine does not train (nothing of them is gathered: a LoRA run's base model)."""
    keep = not rank0_only or engine.topology.rank == 0
    fragments = defaultdict(list)
    for fragment in engine.fragments():
        fragments[fragment.name].append(fragment)
    trainable = {id(p) for p in engine.trainable_params()}  # the same on every rank (fragments are not)
    values: dict[int, torch.Tensor] = {}
    for name, param in engine.module.named_parameters():
        if id(param) in trainable:
            value = _master_value(engine, param, fragments[name])
        elif exclude_frozen_parameters:
            continue
        else:
            value = _model_value(engine, param)
        if keep:
            values[id(param)] = value
    return _in_state_dict_order(engine.module, values) if keep else {}


def live_state_dict(engine: CheckpointedEngine, rank0_only: bool = True,
                    exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The model's own values (the training dtype, not the fp32 masters) as CPU tensors, in
    ``module.state_dict()``'s order; ``{}`` on ranks other than 0 when ``rank0_only``. A collective at stage 3,
    where each unit is gathered in turn (``exclude_frozen_parameters``: only the trained parameters')."""
    keep = not rank0_only or engine.topology.rank == 0
    gathered = {}
    if exclude_frozen_parameters:
        trained = {id(p) for p in engine.trainable_params()}
        items = ((param, _model_value(engine, param)) for param in engine.module.parameters() if id(param) in trained)
    else:  # every rank walks it: each item is a collective gather
        items = ((param, param.detach().to("cpu", copy=True)) for _, param in engine.iter_full_params())
    for param, value in items:
        if keep:
            gathered[id(param)] = value
    return _in_state_dict_order(engine.module, gathered) if keep else {}


def _in_state_dict_order(module: nn.Module, values: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module.state_dict()``'s keys, with ``values`` (by parameter id) for parameters and CPU copies of the
    buffers; a parameter missing from ``values`` (left out: exclude_frozen_parameters) is left out."""
    params = {id(p) for p in module.parameters()}
    return {key: values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True)
            for key, t in state_dict_entries(module) if id(t) in values or id(t) not in params}


def _master_value(engine, param: nn.Parameter, fragments: list) -> torch.Tensor:
    """A trainable parameter's fp32 master, whole: each rank fills its fragments, one all-reduce sums them."""
    return whole_value(engine, param.shape, fragments).cpu()  # NVMe: a piece bigger than a tile in slices


def _model_value(engine, param: nn.Parameter) -> torch.Tensor:
    """A frozen parameter as the model holds it (stage 3 gathers its unit for the copy, then releases it)."""
    opened = engine.gather_params([param])
    try:
        return param.detach().to("cpu", copy=True)
    finally:
        engine.commit_params([param], opened, modified=False)
