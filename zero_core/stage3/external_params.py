"""Parameters used outside their own module's forward, and gathering parameters by hand.

``register_external_parameter(module, param)`` tells stage 3 that ``module``'s forward (and backward) uses
``param``, which another module owns, so it is gathered with ``module`` too. A parameter that a module holds
directly but that another module owns (tied weights) is found automatically at setup; so is a module that
returns one of its own parameters (kept gathered until the end of that backward).
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional

import torch
from torch import nn

from zero_core import registry
from zero_core.arg_checks import check_module, check_parameter, described

_EXTERNALS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` whenever ``module`` runs (stage 3; harmless for stages 1 and 2)."""
    if isinstance(module, nn.Parameter) and isinstance(parameter, nn.Module):
        raise TypeError("zero_core.register_external_parameter: the arguments are swapped (got a parameter, then "
                        f"{described(parameter)}): pass the module that uses the parameter first, then the "
                        "parameter: register_external_parameter(self, self.other.weight)")
    check_module(module, "zero_core.register_external_parameter", "module",
                 "Pass the module whose forward uses the parameter (usually self)")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"zero_core.register_external_parameter: parameter must be an nn.Parameter, got {described(parameter)}. "
            "Pass the parameter object itself (e.g. self.layer1.weight)"
        )
    entries = _EXTERNALS.setdefault(module, [])
    if not any(p is parameter for p in entries):
        entries.append(parameter)
    engine = registry.engine_of(parameter)
    if engine is not None:
        engine.runtime.add_external_after_setup(module, parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    entries = _EXTERNALS.get(module, [])
    _EXTERNALS[module] = [p for p in entries if p is not parameter]


def registered_externals(root: nn.Module) -> Iterator[tuple[nn.Module, list]]:
    for module in root.modules():
        if _EXTERNALS.get(module):
            yield module, list(_EXTERNALS[module])


def _as_tensors(params) -> list[torch.Tensor]:
    """``GatheredParameters``' parameters: one tensor or an iterable of tensors (a module's .parameters())."""
    call = "zero_core.GatheredParameters"
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, nn.Module):
        raise TypeError(f"{call}: params must be parameters, got the module {described(params)}. Pass "
                        "module.parameters() (or one parameter, e.g. module.weight)")
    try:
        params = list(params)
    except TypeError:
        raise TypeError(f"{call}: params must be a parameter or an iterable of parameters, got {described(params)}. "
                        "Pass e.g. model.layer.weight or model.layer.parameters()") from None
    for index, param in enumerate(params):
        check_parameter(param, call, f"params[{index}]")
    return params


class GatheredParameters:
    """Gather partitioned parameters for the duration of a ``with`` block (a collective: every rank enters).

    With ``modifier_rank=r``, rank ``r``'s values at the end of the block are broadcast and written back into
    every shard (and the fp32 masters). Parameters not managed by ZeRO pass through untouched. ``fwd_module`` is
    accepted for DeepSpeed compatibility and not needed here (external use is registered per module instead).
    """

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module: Optional[nn.Module] = None,
                 enabled: bool = True) -> None:
        self.params = _as_tensors(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._opened: dict = {}

    def _by_owner(self) -> dict:
        owners: dict = {}
        for param in self.params:
            owner = registry.owner_of(param)
            if owner is not None:
                owners.setdefault(id(owner), (owner, []))[1].append(param)
        return owners

    def __enter__(self):
        if self.enabled:
            for key, (owner, params) in self._by_owner().items():
                self._opened[key] = owner.gather_params(params, self.modifier_rank is not None)
        return self.params

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        modified = self.modifier_rank is not None and exc_type is None
        for key, (owner, params) in self._by_owner().items():
            if modified:
                for param in params:
                    with torch.no_grad():
                        owner.comm.broadcast(param.data, src=self.modifier_rank)
            owner.commit_params(params, self._opened.pop(key, []), modified)
