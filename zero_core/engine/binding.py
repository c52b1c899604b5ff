"""Which optimizer owns what: the user's optimizer groups, the units (flat groups, stage 3 units) each
optimizer steps, and each trainable parameter's optimizer and flag slot. Rebuilt whenever the groups change
(setup, ``add_param_group``, ``replace_optimizers``, parameters unfrozen after setup)."""

from __future__ import annotations

import os
import warnings
from typing import Union

import torch
from torch import nn

from zero_core.arg_checks import described
from zero_core.config import ZeroConfig
from zero_core.optim.sharded_optimizer import ShardedOptimizer, narrow_param_groups, new_group_params

OptimizerRef = Union[int, torch.optim.Optimizer, None]


class OptimizerBinding:
    """The optimizer groups (counted across optimizers) and the units each optimizer steps.

    ``group_params`` / ``group_param_names``: each group's own parameters (frozen ones included), before
    narrowing to master shards; ``group_optimizer``: each group's optimizer index; ``units_of[k]``: the units
    optimizer ``k`` steps; ``optimizer_by_id`` / ``flag_slot``: keyed by ``id(param)``, so that per-gradient and
    per-step lookups need no ``Tensor.__hash__`` (a Python call)."""

    def __init__(self, module: nn.Module, names: dict) -> None:
        self.module = module
        self.names = names
        self.inner_optimizers: list[torch.optim.Optimizer] = []
        self.group_params: list[list[nn.Parameter]] = []
        self.group_param_names: list[list[str]] = []
        self.group_optimizer: list[int] = []
        self.units_of: list[list] = []
        self.optimizer_of: dict = {}
        self.optimizer_by_id: dict[int, int] = {}
        self.flag_slot: dict[int, int] = {}
        self.managed_ids: set[int] = set()
        self.unmanaged: list[nn.Parameter] = []
        self.unsharded: list[list[nn.Parameter]] = []

    def record_groups(self, groups: list[dict]) -> None:
        """Each optimizer group's own parameters (frozen ones included), before narrowing to master shards."""
        self.group_params = [list(g["params"]) for g in groups]
        self.group_param_names = [[self.names.get(p, "?") for p in params] for params in self.group_params]

    def trainable_by_group(self, groups: list[dict]) -> list[list[nn.Parameter]]:
        """Each optimizer group's trainable parameters, checked to belong to the model and to one group only."""
        by_group, seen = [], {}
        for index, group in enumerate(groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for param in trainable:
                if param not in self.names:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                        "in the model passed to zero_core.setup; build the optimizer from model.parameters()"
                    )
                if param in seen:
                    raise ValueError(
                        f"parameter '{self.names[param]}' is in two optimizer groups ({seen[param]} and {index}, "
                        "counted across all optimizers); give each parameter to one optimizer group only"
                    )
                seen[param] = index
            by_group.append(trainable)
        orphans = [n for p, n in self.names.items() if p.requires_grad and p not in seen]
        if orphans:
            warnings.warn(
                f"these trainable parameters are in no optimizer group, so ZeRO neither reduces nor updates them: "
                f"{', '.join(orphans)}. Add them to the optimizer or set requires_grad=False.",
                stacklevel=4,
            )
        return by_group

    def bind(self, optimizers: list[torch.optim.Optimizer], units: list) -> None:
        """Narrow each optimizer's groups to this rank's master shards of ``units`` (the runtime's)."""
        self.inner_optimizers = list(optimizers)
        self.group_optimizer = [k for k, opt in enumerate(optimizers) for _ in opt.param_groups]
        self.index(units)
        start = 0
        for optimizer in optimizers:
            indices = range(start, start + len(optimizer.param_groups))
            narrow_param_groups(optimizer, [[m for unit in units if unit.group_index == i
                                             for m in unit.masters] for i in indices])
            start += len(optimizer.param_groups)

    def index(self, units: list) -> None:
        """Which units each optimizer steps; each trainable parameter's optimizer and flag slot."""
        self.units_of = [[unit for unit in units if self.group_optimizer[unit.group_index] == k]
                         for k in range(len(self.inner_optimizers))]
        self.optimizer_of = {p: k for k, owned in enumerate(self.units_of) for unit in owned for p in unit.params}
        self.managed_ids = {id(p) for p in self.optimizer_of}  # per-step membership tests without Tensor.__hash__
        # Each trainable parameter's slot in its optimizer's "got a gradient" flags (No gradient, no step)
        self.flag_slot = {id(p): i for owned in self.units_of
                          for i, p in enumerate(p for unit in owned for p in unit.params)}
        self.optimizer_by_id = {id(p): k for p, k in self.optimizer_of.items()}
        # zero_grad clears these (frozen, in no group, or unfrozen but not sharded yet): listed once here, as
        # walking module.parameters() at every step is Python per module
        self.unmanaged = [p for p in self.module.parameters() if id(p) not in self.managed_ids]
        # Each group's parameters without master shards (frozen when it was set up): the only ones the engine
        # has to look at, at every step, for parameters unfrozen since
        self.unsharded = [[p for p in params if id(p) not in self.managed_ids] for params in self.group_params]

    def units(self, indices: list[int]) -> list:
        """The units optimizers ``indices`` step, in order."""
        return [unit for k in indices for unit in self.units_of[k]]

    def optimizer_indices(self, optimizer: OptimizerRef, count: int) -> list[int]:
        """Which of the ``count`` optimizers ``optimizer`` means (see ZeroEngine.optimizer_indices)."""
        if optimizer is None:
            return list(range(count))
        if isinstance(optimizer, int):
            if not 0 <= optimizer < count:
                raise IndexError(f"optimizer index {optimizer} is out of range: this engine has "
                                 f"{count} optimizers")
            return [optimizer]
        inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer  # a facade: its optimizer
        for k, candidate in enumerate(self.inner_optimizers):
            if inner is candidate:
                return [k]
        raise ValueError(f"{type(optimizer).__name__} is not one of this engine's optimizers: pass one given to "
                         "zero_core.setup, its facade from engine.optimizers, or its index")

    def insert_group(self, k: int, param_group: dict, units: list) -> None:
        """A new group of optimizer ``k`` after its last one: the later groups' indices (in ``units`` too) move."""
        params = new_group_params(param_group, self.names, self.group_params)
        insert_at = max(i for i, owner in enumerate(self.group_optimizer) if owner == k) + 1
        for unit in units:
            if unit.group_index >= insert_at:
                unit.group_index += 1
        self.group_optimizer.insert(insert_at, k)
        self.group_params.insert(insert_at, params)
        self.group_param_names.insert(insert_at, [self.names[p] for p in params])
        inner = self.inner_optimizers[k]
        type(inner).add_param_group(inner, {**param_group, "params": []})  # torch fills in the defaults
        self.index(units)

    def newly_trainable(self) -> dict[int, list[nn.Parameter]]:
        """Per group: its parameters without master shards that require a gradient now."""
        fresh = {i: [p for p in params if p.requires_grad] for i, params in enumerate(self.unsharded) if params}
        return {i: params for i, params in fresh.items() if params}

    def add_masters(self, new_units: list) -> None:
        """The inner optimizers step the masters of ``new_units`` (units made trainable after setup)."""
        for unit in new_units:
            k = self.group_optimizer[unit.group_index]
            local = unit.group_index - self.group_optimizer.index(k)
            self.inner_optimizers[k].param_groups[local]["params"].extend(unit.masters)

    def check_same_groups(self, groups: list[dict]) -> None:
        """``replace_optimizers``: the new groups hold the same trainable parameters as the current ones."""
        names = [[self.names.get(p, "?") for p in g["params"] if p.requires_grad] for g in groups]
        trainable = {self.names[p] for p in self.optimizer_of}
        before = [[n for n in group if n in trainable] for group in self.group_param_names]
        if names != before:
            raise ValueError(
                "the new optimizers group the trainable parameters differently from the ones this engine was set "
                f"up with ({len(names)} groups, first names {[g[:2] for g in names]}; before: {len(before)} groups, "
                f"{[g[:2] for g in before]}). The engine's flat buffers follow the optimizer groups: build the "
                "optimizers the same way, or set up a fresh model"
            )


def as_optimizer_list(optimizer, call: str = "zero_core.setup") -> list[torch.optim.Optimizer]:
    """``optimizer`` (one or a list) checked to be torch optimizers; the error names the argument and the fix."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError(f"{call} needs at least one optimizer")
    for index, candidate in enumerate(optimizers):
        if not isinstance(candidate, torch.optim.Optimizer):
            where = f"optimizer[{index}]" if len(optimizers) > 1 else "optimizer"
            raise TypeError(f"{call}: {where} must be a torch.optim.Optimizer, got {described(candidate)}. "
                            f"{_optimizer_fix(candidate)}")
    return optimizers


def _optimizer_fix(candidate) -> str:
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
        return f"Build it first: torch.optim.{candidate.__name__}(model.parameters(), lr=...)"
    if isinstance(candidate, (dict, str, os.PathLike, ZeroConfig)):
        return "The configuration is the third argument: zero_core.setup(model, optimizer, config)"
    return ("Pass the optimizer itself (a wrapper's inner optimizer, e.g. .optimizer), built over "
            "model.parameters(): zero_core.setup(model, optimizer, config)")
