"""Stage 3 generation sessions inside the runtime: which gathered units stay gathered across decoding steps.

``GenerationKeeping`` is a mixin of ``PartitionedParamsRuntime`` (runtime.py), as ``Prefetch`` is: it owns the
session state (``_keep_budget``, ``_keep_all``, the unguarded units) and the rules; generation.py opens and
closes sessions (``GenerationSession``) and docs/stage3.md ("Generation") explains them.
"""

from __future__ import annotations

from typing import Optional

import torch

from zero_core.stage3.param_unit import ParamUnit, UnitState
from zero_core.stage3.partitioned_param import mark_partitioned, unmark_partitioned


class GenerationKeeping:
    """Keep-gathered decisions of generation sessions (a mixin: it reads the runtime's ``units``,
    ``live_elements``, ``_start_gather`` and ``release_all``)."""

    def _init_generation(self) -> None:
        self._keep_budget: Optional[int] = None  # set while a session keeps units: its budget in elements
        self._generation_depth = 0
        self._largest_unit = 0
        self._keep_all = False  # the session's budget holds the whole model: gathered once, nothing released
        self._unguarded: set[ParamUnit] = set()  # kept units whose parameters skip the guard

    def begin_generation(self, budget: int) -> bool:
        """Until ``end_generation``: no-grad forwards keep units gathered while ``budget`` elements allow. Where
        the whole model fits, it is gathered here, once, and nothing is released until the end: the forwards
        then issue no collective, and the result (True) says so, so that ranks may decode on their own."""
        self._generation_depth += 1
        if self._generation_depth > 1 or budget <= 0:  # 0: nothing kept, training's rules
            return self._keep_all
        self._keep_budget = int(budget)
        self._largest_unit = max((u.numel for u in self.units if not u.persistent), default=0)
        sharded = [u for u in self.units if u.state is UnitState.SHARDED]
        self._keep_all = self.live_elements + sum(u.numel for u in sharded) <= self._keep_budget
        if self._keep_all:
            self._start_gather(sharded, "forward")
        for unit in self.units:
            unit.wait()
            if self._keep_all or unit.persistent:
                self._unguard(unit)
        return self._keep_all

    def end_generation(self) -> None:
        """Leave generation: release what it kept (memory back to the training level)."""
        self._generation_depth -= 1
        if self._generation_depth == 0:
            self._keep_budget, self._keep_all = None, False
            self.release_all()
            for unit in list(self._unguarded):
                self._guard(unit)

    def kept_for_generation(self, unit: ParamUnit) -> bool:
        """After a forward used ``unit`` (counted in ``live_elements``): whether a generation session keeps it
        gathered. A session holding the whole model keeps everything (also through a forward with gradients, its
        backward and a step, which gathers the updated values again: after_step). Partly fitting models keep a
        unit after no-grad forwards if the largest unit can still be gathered beside everything kept without
        passing the budget, so kept units never push a later gather over it."""
        budget = self._keep_budget
        if budget is None or not (self._keep_all or not torch.is_grad_enabled()):
            return False  # a forward with gradients in a partly kept session: training's rules
        if self._keep_all or self.live_elements + self._largest_unit <= budget:
            self._unguard(unit)
            return True
        return False

    def _unguard(self, unit: ParamUnit) -> None:
        """A kept unit's parameters become plain ``nn.Parameter``s until released: the guard's Python call per
        operation on them (partitioned_param.py) would cost a decoding step more than the layer's compute."""
        if unit not in self._unguarded and unit.state is UnitState.GATHERED:
            self._unguarded.add(unit)
            for param in unit.params:
                unmark_partitioned(param)

    def _guard(self, unit: ParamUnit) -> None:
        """Released (or the session ended): the guard watches the unit's parameters again."""
        if unit in self._unguarded:
            self._unguarded.discard(unit)
            for param in unit.params:
                mark_partitioned(param)
