"""Stage 3 generation sessions inside the runtime: which gathered units stay gathered across decoding steps.

``GenerationKeeping`` is a part of ``PartitionedParamsRuntime`` (runtime.py), written as a mixin, as ``Prefetch``
is: it holds the rules, and moves the session's state (``GenerationState``, state.py: the budget, whether the
whole model is kept, the unguarded units), which the runtime owns as ``generation``; what it needs of the runtime
is ``GenerationHost``. generation.py opens and closes sessions (``GenerationSession``) and docs/stage3.md
("Generation") explains them.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from zero_core.stage3.param_unit import ParamUnit, UnitState
from zero_core.stage3.partitioned_param import mark_partitioned, unmark_partitioned
from zero_core.stage3.state import GenerationState


@runtime_checkable
class GenerationHost(Protocol):
    """What ``GenerationKeeping`` reads and calls on the runtime it is part of."""

    units: list[ParamUnit]
    live_elements: int
    generation: GenerationState
    _start_gather: Callable[[list[ParamUnit], str], None]
    release_all: Callable[[], None]


class GenerationKeeping:
    """Keep-gathered decisions of generation sessions: ``begin_generation``, ``end_generation``,
    ``kept_for_generation``, and ``_guard``/``_unguard`` for the kept units' parameters. Needs
    ``GenerationHost``."""

    def begin_generation(self, budget: int) -> bool:
        """Until ``end_generation``: no-grad forwards keep units gathered while ``budget`` elements allow. Where
        the whole model fits, it is gathered here, once, and nothing is released until the end: the forwards
        then issue no collective, and the result (True) says so, so that ranks may decode on their own."""
        session = self.generation
        session.depth += 1
        if session.depth > 1 or budget <= 0:  # 0: nothing kept, training's rules
            return session.keep_all
        session.budget = int(budget)
        session.largest_unit = max((u.numel for u in self.units if not u.persistent), default=0)
        sharded = [u for u in self.units if u.state is UnitState.SHARDED]
        session.keep_all = self.live_elements + sum(u.numel for u in sharded) <= session.budget
        if session.keep_all:
            self._start_gather(sharded, "forward")
        for unit in self.units:
            unit.wait()
            if session.keep_all or unit.persistent:
                self._unguard(unit)
        return session.keep_all

    def end_generation(self) -> None:
        """Leave generation: release what it kept (memory back to the training level)."""
        session = self.generation
        session.depth -= 1
        if session.depth == 0:
            session.budget, session.keep_all = None, False
            self.release_all()
            for unit in list(session.unguarded):
                self._guard(unit)

    def kept_for_generation(self, unit: ParamUnit) -> bool:
        """After a forward used ``unit`` (counted in ``live_elements``): whether a generation session keeps it
        gathered. A session holding the whole model keeps everything (also through a forward with gradients, its
        backward and a step, which gathers the updated values again: after_step). Partly fitting models keep a
        unit after no-grad forwards if the largest unit can still be gathered beside everything kept without
        passing the budget, so kept units never push a later gather over it."""
        session = self.generation
        budget = session.budget
        if budget is None or not (session.keep_all or not torch.is_grad_enabled()):
            return False  # a forward with gradients in a partly kept session: training's rules
        if session.keep_all or self.live_elements + session.largest_unit <= budget:
            self._unguard(unit)
            return True
        return False

    def _unguard(self, unit: ParamUnit) -> None:
        """A kept unit's parameters become plain ``nn.Parameter``s until released: the guard's Python call per
        operation on them (partitioned_param.py) would cost a decoding step more than the layer's compute."""
        unguarded = self.generation.unguarded
        if unit not in unguarded and unit.state is UnitState.GATHERED:
            unguarded.add(unit)
            for param in unit.params:
                unmark_partitioned(param)

    def _guard(self, unit: ParamUnit) -> None:
        """Released (or the session ended): the guard watches the unit's parameters again."""
        unguarded = self.generation.unguarded
        if unit in unguarded:
            unguarded.discard(unit)
            for param in unit.params:
                mark_partitioned(param)
