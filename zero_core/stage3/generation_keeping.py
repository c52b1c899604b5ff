"""Stage 3 generation sessions inside the runtime: which gathered units stay gathered across decoding steps.

``GenerationKeeping`` is the runtime's ``generation`` (runtime.py): it owns a session's state (the budget,
whether the whole model is kept, the units whose parameters skip the guard) and the keep rules, and is handed
what it needs per call (the units, the live elements, the runtime's gather verb), so it reaches into nothing.
generation.py opens and closes sessions (``GenerationSession``) and docs/stage3.md ("Generation") explains them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from zero_core.stage3.param_unit import ParamUnit, UnitState
from zero_core.stage3.partitioned_param import mark_partitioned, unmark_partitioned


class GenerationKeeping:
    """A generation session's keeping; outside a session (``budget`` None) training's rules apply. The hooks read
    ``keep_all`` and ``budget`` directly."""

    __slots__ = ("budget", "depth", "largest_unit", "keep_all", "unguarded")

    def __init__(self) -> None:
        self.budget: Optional[int] = None  # set while a session keeps units: its budget in elements
        self.depth = 0  # sessions now open (nested ones share the outermost's budget)
        self.largest_unit = 0  # the largest unit that may still be gathered beside what is kept
        self.keep_all = False  # the budget holds the whole model: gathered once, nothing released
        self.unguarded: set[ParamUnit] = set()  # kept units whose parameters skip the guard

    def begin(self, budget: int, units: list[ParamUnit], live_elements: int,
              unshard: Callable[[list[ParamUnit], str], None]) -> bool:
        """Until ``end``: no-grad forwards keep units gathered while ``budget`` elements allow. Where the whole
        model fits, it is gathered here (``unshard``), once, and nothing is released until the end: the forwards
        then issue no collective, and the result (True) says so, so that ranks may decode on their own."""
        self.depth += 1
        if self.depth > 1 or budget <= 0:  # 0: nothing kept, training's rules
            return self.keep_all
        self.budget = int(budget)
        self.largest_unit = max((u.numel for u in units if not u.persistent), default=0)
        sharded = [u for u in units if u.state is UnitState.SHARDED]
        self.keep_all = live_elements + sum(u.numel for u in sharded) <= self.budget
        if self.keep_all:
            unshard(sharded, "forward")
        for unit in units:
            unit.wait()
            if self.keep_all or unit.persistent:
                self.unguard(unit)
        return self.keep_all

    def end(self) -> bool:
        """Leave a session; True when it was the outermost: the caller releases what it kept, then calls
        ``guard_all`` (memory and the guard back to the training level)."""
        self.depth -= 1
        if self.depth != 0:
            return False
        self.budget, self.keep_all = None, False
        return True

    def keeps(self, unit: ParamUnit, live_elements: int) -> bool:
        """After a forward used ``unit`` (counted in ``live_elements``): whether the session keeps it gathered. A
        session holding the whole model keeps everything (also through a forward with gradients, its backward
        and a step, which gathers the updated values again: after_step). Partly fitting models keep a unit after
        no-grad forwards if the largest unit can still be gathered beside everything kept without passing the
        budget, so kept units never push a later gather over it."""
        budget = self.budget
        if budget is None or not (self.keep_all or not torch.is_grad_enabled()):
            return False  # a forward with gradients in a partly kept session: training's rules
        if self.keep_all or live_elements + self.largest_unit <= budget:
            self.unguard(unit)
            return True
        return False

    def unguard(self, unit: ParamUnit) -> None:
        """A kept unit's parameters become plain ``nn.Parameter``s until released: the guard's Python call per
        operation on them (partitioned_param.py) would cost a decoding step more than the layer's compute."""
        if unit not in self.unguarded and unit.state is UnitState.GATHERED:
            self.unguarded.add(unit)
            for param in unit.params:
                unmark_partitioned(param)

    def guard(self, unit: ParamUnit) -> None:
        """Released (or the session ended): the guard watches the unit's parameters again."""
        if unit in self.unguarded:
            self.unguarded.discard(unit)
            for param in unit.params:
                mark_partitioned(param)

    def guard_all(self) -> None:
        for unit in list(self.unguarded):
            self.guard(unit)
