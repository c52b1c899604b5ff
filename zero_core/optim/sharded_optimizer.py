"""The user's optimizer, narrowed to this rank's fp32 master shards, behind a torch Optimizer facade.

The user's own optimizer object becomes the inner optimizer: its ``param_groups`` dicts stay the same objects
(learning rate, weight decay and every other hyper-parameter per group), only their ``"params"`` lists now
hold this rank's master shards. So an LR scheduler built on the user's optimizer before ``setup`` keeps
working, and so does one built on ``engine.optimizer`` after: both change the same dicts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from zero_core.checkpoint import shard_identity


def narrow_param_groups(optimizer: torch.optim.Optimizer, masters_per_group: Sequence[list[nn.Parameter]]) -> None:
    """Replace each group's parameters with its master shards, keeping the group dicts themselves."""
    if optimizer.state:
        raise ValueError(
            f"the {type(optimizer).__name__} passed to zero_core.setup already holds state (it has stepped): "
            "create the optimizer, call setup, then train; to resume, load a checkpoint through the engine"
        )
    for group, masters in zip(optimizer.param_groups, masters_per_group):
        group["params"] = list(masters)


def new_group_params(param_group: dict, names: dict, groups: Sequence[list]) -> list[nn.Parameter]:
    """The parameters of a group added after setup, checked: model parameters, in no group yet."""
    params = param_group.get("params")
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set) or params is None:
        raise TypeError("add_param_group: 'params' must be a list of the model's parameters (a set has no order)")
    params = list(params)
    taken = {id(p) for group in groups for p in group}
    for param in params:
        if param not in names:
            raise ValueError(
                f"add_param_group got a tensor of shape {tuple(getattr(param, 'shape', ()))} that is not a parameter "
                "of the model passed to zero_core.setup: the engine trains the model's parameters only. Make it a "
                "parameter of the model (a submodule or nn.Parameter attribute) before setup, or give it to a "
                "separate optimizer outside the engine"
            )
        if id(param) in taken:
            raise ValueError(f"add_param_group: parameter '{names[param]}' is already in an optimizer group; give "
                             "each parameter to one group only")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("add_param_group: a parameter is listed twice in the new group")
    return params


class ShardedOptimizer(torch.optim.Optimizer):
    """What front-ends and users step: ``step`` and ``zero_grad`` go through the engine.

    ``Optimizer.__init__`` is not called on purpose: the parameter groups already exist in the inner optimizer
    and are shared, not copied.
    """

    def __init__(self, inner: torch.optim.Optimizer, step_fn: Callable[[], None], zero_grad_fn: Callable[[], None],
                 add_param_group_fn: Callable[[dict], None]):
        self.inner = inner
        self._step_fn = step_fn
        self._zero_grad_fn = zero_grad_fn
        self._add_param_group_fn = add_param_group_fn
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.inner.param_groups = value

    @property
    def state(self):
        return self.inner.state

    @state.setter
    def state(self, value) -> None:
        self.inner.state = value

    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_fn()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_grad_fn()

    def add_param_group(self, param_group: dict) -> None:
        """Model parameters join as a new group (e.g. a backbone unfrozen mid-run); see docs/core-api.md."""
        self._add_param_group_fn(param_group)

    # Set by the engine: this shard's identity (rank, world size, layout), see zero_core.checkpoint.shard_identity.
    describe_shard: Optional[Callable[[], dict]] = None

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, with its identity under ``"zero_shard"`` (rank, world
        size, stage, layout). Not a collective. For checkpoints that load anywhere use the engine's
        (docs/core-api.md)."""
        state = self.inner.state_dict()
        return state if self.describe_shard is None else shard_identity.stamp(state, self.describe_shard())

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what this rank's ``state_dict()`` gave, in the same topology and layout; anything else (another
        rank's shard, another world size or layout, a partial or a plain unsharded state) raises."""
        if self.describe_shard is not None:
            state_dict = shard_identity.check_loadable(state_dict, self.describe_shard(), type(self).__name__)
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.inner!r})"
