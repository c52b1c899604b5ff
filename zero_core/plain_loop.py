"""The plain PyTorch loop after ``setup``: the user's own optimizer object steps and zeroes through the engine.

``zero_core.setup`` narrows the user's optimizer to this rank's fp32 master shards (sharded_optimizer.py). Left
alone, its ``step()`` would see masters without gradients and change nothing. So each user optimizer gets
instance-level ``step``/``zero_grad`` that call the engine (``engine.optimizers[k]``); while the engine runs the
real update over the masters, ``step`` is the optimizer's own again.

LR schedulers wrap ``optimizer.step`` on the instance to count calls (``_opt_called``, ``_wrapped_by_lr_sched``);
a wrapper installed before setup stays in the chain (it runs on the real update), and one installed after setup
wraps the routed ``step``, so both keep counting. ``unroute`` restores the optimizer as it was.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator, Optional

import torch

_MISSING = object()


class OptimizerRoute:
    """The routed ``step``/``zero_grad`` of one user optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable, zero_grad: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self._engine_step = step
        self._engine_zero_grad = zero_grad
        self._inside = False  # the engine is running the real update: step() must not route again
        self._before = {name: optimizer.__dict__.get(name, _MISSING) for name in ("step", "zero_grad")}
        self._install()

    def _real_step(self, closure: Optional[Callable] = None):
        previous = self._before["step"]  # an LR scheduler's counting wrapper from before setup, if any
        if previous is not _MISSING:
            return previous(closure) if closure is not None else previous()
        return type(self.optimizer).step(self.optimizer, closure)

    def _install(self) -> None:
        route = self

        def step(optimizer, closure=None):
            if route._inside:
                return route._real_step(closure)
            return route._engine_step(closure)

        def zero_grad(optimizer, set_to_none: bool = True):
            route._engine_zero_grad()

        previous = self._before["step"]
        if previous is not _MISSING and getattr(previous, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # the scheduler's wrapper still runs (inside), so it still counts
        self.optimizer.step = types.MethodType(step, self.optimizer)  # a bound method: schedulers need __func__
        self.optimizer.zero_grad = types.MethodType(zero_grad, self.optimizer)

    @contextlib.contextmanager
    def real_update(self) -> Iterator[None]:
        """While open, ``optimizer.step()`` is the update over the master shards (the engine's inner step)."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def unroute(self) -> None:
        for name, value in self._before.items():
            if value is _MISSING:
                self.optimizer.__dict__.pop(name, None)
            else:
                setattr(self.optimizer, name, value)
