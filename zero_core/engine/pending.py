"""Which gradients each optimizer holds since its last step or zero_grad ("no gradient, no step").

The gradient hooks only record which parameters got a gradient (grad_notes.GradNotes: a list append, no Python
per gradient); :meth:`PendingGradients.collect` moves those records into each optimizer's ``PendingGrads``
before anything reads them. Once some optimizer's gradients are reduced ahead of its step, the hooks call
:meth:`PendingGradients.arrived` instead, which can refuse a gradient that would be lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from zero_core.grad_notes import GradNotes
from zero_core.weak_hooks import weakly


@dataclass
class PendingGrads:
    """One optimizer's gradients since its last step or zero_grad."""

    saw_grad: bool = False  # a backward produced a gradient for one of its parameters
    reduced: bool = False  # they were reduced (by clipping, reduce_gradients or the step)
    clip_coef: Optional[torch.Tensor] = None
    used: set = field(default_factory=set)  # ids of the parameters that got a gradient here (on this rank)
    unscaled: bool = False  # a gradient came from a backward outside engine.backward (fp16: not loss-scaled)


class PendingGradients:
    """Every optimizer's ``PendingGrads``, fed by the gradient hooks' records.

    The binding's ``optimizer_by_id`` (read at each use: adding a group rebuilds it) tells each parameter's
    optimizer; ``averages_whole_grads`` is the runtime's; ``names`` names parameters in errors."""

    def __init__(self, binding, averages_whole_grads: Callable[[], bool], names: dict) -> None:
        self._binding = binding
        self._averages_whole_grads = averages_whole_grads
        self._names = names
        self.of_optimizer: list[PendingGrads] = []
        self.inside_backward = False  # inside engine.backward (which applies the fp16 loss scale)
        self.notes = GradNotes(weakly(self.arrived))  # the hooks hold this record weakly: it goes with its engine

    def reset(self, count: int) -> None:
        """A fresh record for ``count`` optimizers (setup, replace_optimizers)."""
        self.of_optimizer = [PendingGrads() for _ in range(count)]

    def clear(self, indices: list[int]) -> None:
        for k in indices:
            self.of_optimizer[k] = PendingGrads()

    def collect(self, scaled: bool = False) -> None:
        """Move the gradients recorded by the hooks into each optimizer's record; ``scaled``: they came from
        ``engine.backward`` (fp16: the loss was scaled). Called before anything reads the record."""
        arrivals = self.notes.take()
        if not arrivals:
            return
        keys = set(map(id, arrivals))
        if len(self.of_optimizer) == 1:
            by_optimizer = {0: keys}
        else:
            by_optimizer = {}
            optimizer_by_id = self._binding.optimizer_by_id
            for key in keys:
                by_optimizer.setdefault(optimizer_by_id[key], set()).add(key)
        for k, used in by_optimizer.items():
            pending = self.of_optimizer[k]
            pending.used |= used
            pending.saw_grad = True
            pending.unscaled |= not scaled

    def arrived(self, param: torch.Tensor) -> None:
        """A gradient's record while armed (``GradNotes.arm``: some optimizer's gradients were reduced already)."""
        key = id(param)
        pending = self.of_optimizer[self._binding.optimizer_by_id[key]]
        pending.used.add(key)
        if pending.reduced and self._averages_whole_grads() and pending.clip_coef is None:
            pending.reduced = False  # averaged gradients plus new local ones average again to the right sum
        elif pending.reduced:
            raise RuntimeError(
                f"a backward produced a gradient for '{self._names.get(param, '?')}' after this step's gradients were "
                "already reduced (by clip_grad_norm_, reduce_gradients or a safe_get_full_grad call), so it would be "
                "lost: run every backward of the step first, then clip, then step()"
            )
        pending.saw_grad = True
        pending.unscaled |= not self.inside_backward

    def arm(self) -> None:
        """A later gradient before the step is recorded in Python (:meth:`arrived`), and may raise there."""
        self.notes.arm()

    def disarm_if_idle(self) -> None:
        """Back to the cheap hooks once no optimizer's gradients are reduced (pending a step) any more."""
        if self.notes.armed and not any(p.reduced for p in self.of_optimizer):
            self.notes.disarm()

    def any_saw_grad(self) -> bool:
        return any(p.saw_grad for p in self.of_optimizer)
