"""One prepared model under ZeRO: its engine, and when its gradients are synchronised.

Accelerate's loops are written against DDP, which decides at *forward* time whether the following backward
reduces gradients (``no_sync`` around the forward, ``trigger_sync_in_backward`` to force it). The engine's own
``no_sync()`` acts at backward time. ``ManagedModel`` records what DDP would have decided at each forward so
that ``ZeroAccelerator.backward`` can run the backward inside ``engine.no_sync()`` exactly when DDP would
not have synchronised.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

import zero_core


class ManagedModel:
    """A user's module, the ``ZeroEngine`` built over it, and its DDP-style synchronisation state."""

    def __init__(self, module: nn.Module, engine: zero_core.ZeroEngine, has_optimizer: bool):
        self.module = module
        self.engine = engine
        self.has_optimizer = has_optimizer
        self.optimizers: dict = {}  # engine optimizer index -> its ZeroAcceleratedOptimizer, once prepared
        self.no_sync_depth = 0
        self.forced_sync = 0
        self.forward_synced = True
        self.grads_arrived = False  # set by any gradient reaching this model in the current backward
        self._hooks = [module.register_forward_pre_hook(self._on_forward)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad)
                        for p in module.parameters() if p.requires_grad]

    def _on_forward(self, module: nn.Module, args) -> None:
        # DDP prepares its reducer only for forwards run with grad enabled; others leave the decision as it was
        if torch.is_grad_enabled():
            self.forward_synced = self.no_sync_depth == 0

    def _on_grad(self, param) -> None:
        self.grads_arrived = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.no_sync_depth += 1
        try:
            with self.engine.no_sync():
                yield
        finally:
            self.no_sync_depth -= 1

    @contextlib.contextmanager
    def forced(self) -> Iterator[None]:
        self.forced_sync += 1
        try:
            yield
        finally:
            self.forced_sync -= 1

    def backward_syncs(self) -> bool:
        """Whether DDP would reduce gradients in the backward about to run."""
        return self.forced_sync > 0 or (self.no_sync_depth == 0 and self.forward_synced)

    def owns(self, params) -> bool:
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for p in params)


