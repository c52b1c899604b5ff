"""Type checks at the public entry points: a wrong argument is reported where it is given, naming the argument,
what was given and the fix, instead of surfacing as an AttributeError deep inside (docs/core-api.md, "Argument
errors"). Only what a user plausibly gets wrong is checked; these run once per call, never per step."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero_core.config import ZeroConfig
from zero_core.contracts import CheckpointedEngine  # a Protocol: whatever satisfies it is an engine here
from zero_core.describe import described  # also imported from here by the entry points


def check_module(value: Any, call: str, argument: str, fix: str) -> None:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{call}: {argument} must be an nn.Module, got {described(value)}. {fix}")


def check_init_module(module: Any) -> None:
    """``zero_core.Init``'s first argument is the module (DeepSpeed's order), not the configuration."""
    if module is None or isinstance(module, nn.Module):
        return
    if isinstance(module, (Mapping, str, os.PathLike, ZeroConfig)):
        raise TypeError(
            f"zero_core.Init: the first argument (module) is the model to partition, got {described(module)}. "
            "Pass the configuration by keyword: zero_core.Init(config={'stage': 3}) (or config=path or a "
            "ZeroConfig), and build the model inside the `with` block")
    check_module(module, "zero_core.Init", "module", "Pass the model to partition, or nothing and build it inside "
                 "the `with` block")


def check_process_group(group: Any, call: str, argument: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{call}: {argument} must be a torch.distributed ProcessGroup or None (the default "
                        f"group), got {described(group)}. Pass the configuration by keyword (config=...) and the "
                        "group from torch.distributed.new_group(...)")


def check_dtype(dtype: Any, call: str) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{call}: dtype must be a torch.dtype or None, got {described(dtype)}. Pass e.g. "
                        "torch.bfloat16, not a string")


def check_engine(engine: Any, call: str) -> None:
    """The checkpoint functions take the engine ``zero_core.setup`` returned, not the model or a path."""
    if isinstance(engine, CheckpointedEngine):
        return
    fix = "Pass the engine that zero_core.setup(model, optimizer, config) returned"
    if isinstance(engine, nn.Module):
        fix += " (zero_core.engine_of(model) finds the engine of a model under ZeRO), not the model"
    elif isinstance(engine, (str, os.PathLike)):
        fix += " first, then the path: " + call + "(engine, path)"
    raise TypeError(f"{call}: engine must be a zero_core engine, got {described(engine)}. {fix}")


def check_parameter(value: Any, call: str, argument: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}: {argument} must be a parameter (a torch.Tensor such as model.layer.weight), got "
                        f"{described(value)}. Pass the parameter object itself, not its name or id()")
