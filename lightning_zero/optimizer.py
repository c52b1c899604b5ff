"""The engine's optimizers as Lightning sees them, and Lightning's optimizer wrappers unwrapped.

The core knows no front-end's wrappers: which of the engine's optimizers a ``LightningOptimizer`` or a Fabric
optimizer stands for is decided here (:func:`optimizer_index`), and the core is given the index.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Optional

import torch
from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch.core.optimizer import LightningOptimizer

import zero_core


class ParamGroupView(MutableMapping):
    """An optimizer group as Lightning sees it: the user's hyper-parameters (the engine's group dict itself,
    so LR schedulers and monitors work as usual), but ``"params"`` are the model's parameters rather than this
    rank's master shards, so ``toggle_optimizer`` freezes the right tensors."""

    def __init__(self, group: dict, params: list) -> None:
        self._group = group
        self._params = params

    def __getitem__(self, key):
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key, value) -> None:
        if key == "params":
            raise ValueError("the parameters of an optimizer group are fixed once the ZeRO engine is set up")
        self._group[key] = value

    def __delitem__(self, key) -> None:
        del self._group[key]

    def __iter__(self):
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)


class ZeroOptimizer(zero_core.ShardedOptimizer):
    """Optimizer ``index`` of the engine as Lightning sees it; ``.optimizer`` is the user's (as with DeepSpeed).
    ``step``/``zero_grad`` act on this optimizer's parameters only."""

    def __init__(self, engine: zero_core.ZeroEngine, index: int = 0) -> None:
        facade = engine.optimizers[index]
        super().__init__(facade.inner, facade.step, facade.zero_grad, facade.add_param_group)
        self.describe_shard = facade.describe_shard
        self._engine = engine
        self.index = index  # which of the engine's optimizers this is

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.inner

    @property
    def param_groups(self) -> list:
        params = [p for p, k in zip(self._engine.group_params, self._engine.group_optimizer) if k == self.index]
        return [ParamGroupView(g, p) for g, p in zip(self.inner.param_groups, params)]

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        """Lightning's BaseFinetuning restores, on resume, the groups it added before the checkpoint: groups
        holding this optimizer's parameters take the given hyper-parameters, further ones are added."""
        current = self.param_groups
        for index, group in enumerate(groups):
            if index >= len(current):
                self.add_param_group(dict(group))
                continue
            if [id(p) for p in group["params"]] != [id(p) for p in current[index]["params"]]:
                raise ValueError(
                    f"optimizer param_groups[{index}] cannot change its parameters once the ZeRO engine is set up; "
                    "add new parameters with add_param_group"
                )
            current[index].update({k: v for k, v in group.items() if k != "params"})
        if len(groups) < len(current):
            raise ValueError(f"optimizer groups cannot be removed once the ZeRO engine is set up ({len(current)} "
                             f"groups, {len(groups)} given)")


def optimizer_index(engine: zero_core.ZeroEngine, optimizer: Optional[torch.optim.Optimizer]) -> Optional[int]:
    """The index of the engine's optimizer that ``optimizer`` is (None stays None: all of them), with
    Lightning's and Fabric's wrappers taken off first."""
    if optimizer is None:
        return None
    if isinstance(optimizer, (LightningOptimizer, _FabricOptimizer)):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.index
    return engine.optimizer_indices(optimizer)[0]  # the engine's facade, or the user's optimizer
