"""The optimizer a user steps under ``ZeroAccelerator``: Accelerate's wrapper around the engine's optimizer."""

from __future__ import annotations

import torch
from accelerate.optimizer import AcceleratedOptimizer

from .managed import ManagedModel


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's ``AcceleratedOptimizer`` over ``engine.optimizer``.

    Steps and ``zero_grad`` are skipped on accumulation micro-batches, as in Accelerate. A step goes through
    the engine (sharded step, fp16 overflow check agreed by every rank), so ``step_was_skipped`` reports
    the engine's skipped fp16 steps. ``state_dict()`` is this rank's shard only, marked as such, and
    ``load_state_dict`` refuses any other (zero_core.checkpoint.shard_identity): use ``accelerator.save_state`` for
    checkpoints.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, managed: ManagedModel):
        # No GradScaler (the engine scales fp16 losses) and no device move (the shards are where they belong).
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.managed = managed

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's own optimizer object, now stepping this rank's fp32 master shards."""
        return self.optimizer.inner

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return None
        engine = self.managed.engine
        skipped_before = engine.skipped_steps
        loss = self.optimizer.step(closure)
        self._is_overflow = engine.skipped_steps > skipped_before
        return loss

    def zero_grad(self, set_to_none=None):
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad()
