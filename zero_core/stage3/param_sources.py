"""Where stage 3 gets a module's whole parameter values from when it partitions them at setup.

One module at a time, so no rank ever holds more than one module's parameters whole:
- an ordinary parameter already holds its values;
- a parameter built on the meta device is materialised and initialised by its module's ``reset_parameters()``;
- a parameter partitioned by ``zero_core.Init`` is gathered from its construction-time shards.
"""

from __future__ import annotations

import torch
from torch import nn

from zero_core import registry


def materialize_meta(module: nn.Module, module_name: str, device: torch.device) -> None:
    """Give ``module``'s own meta parameters and buffers real storage (same Parameter objects) and initialise
    them with the module's ``reset_parameters()``."""
    metas = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta]
    meta_buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b.is_meta]
    if not metas and not meta_buffers:
        return
    if not hasattr(module, "reset_parameters"):
        names = ", ".join(f"{module_name}.{n}" if module_name else n for n, _ in metas + meta_buffers)
        raise ValueError(
            f"{names} are on the meta device and their module '{module_name or type(module).__name__}' "
            "has no reset_parameters() to initialise them: define reset_parameters(), build the model under "
            "zero_core.Init(), or materialise it before zero_core.setup"
        )
    for _, param in metas:
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad)
        torch.utils.swap_tensors(param, real)
    for name, buffer in meta_buffers:
        module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
    module.reset_parameters()


def whole_value(param: nn.Parameter) -> torch.Tensor:
    """The parameter's whole value; Init-partitioned parameters are gathered (and their Init storage freed)."""
    partition = registry.pending_partition_of(param)
    return partition.take_whole_value(param) if partition is not None else param.detach()


def comes_from_init(param: nn.Parameter) -> bool:
    """Values from zero_core.Init are already identical on every rank: no broadcast needed."""
    return registry.pending_partition_of(param) is not None
