"""The module execution order that stage 3 prefetches along.

The first step records the order in which managed modules run their forward. At the end of that step every
rank compares its order with the others (one small all-gather): identical orders make the trace valid;
different orders are an error that names where the ranks part ways. While valid, each forward is checked
against the trace as it runs: a module found further on means the modules in between were skipped on this
rank (divergence.py issues their collectives); a module out of place (another code path) stops prefetching for
the rest of the step, and when any rank was out of place (agreed at the step barrier) the next step records
again. Prefetch only ever follows a trace that every rank agreed on.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional

from torch import nn

from zero_core.comm.plain_exchange import all_gather_json


class TraceState(enum.Enum):
    RECORDING = "recording"
    VALID = "valid"


class ExecutionTrace:
    """Records, validates and follows the forward order of managed modules."""

    def __init__(self, module_names: dict[nn.Module, str], comm) -> None:
        self.module_names = module_names
        self._index = {m: i for i, m in enumerate(module_names)}
        self.comm = comm
        self.state = TraceState.RECORDING
        self.order: list[nn.Module] = []
        self.position = 0
        self.deviated = False
        self._skipped: list[int] = []
        self._distances: dict = {}

    def reset(self) -> None:
        """Forget the trace (the set of managed modules changed): record again from the next forward."""
        self._index = {m: i for i, m in enumerate(self.module_names)}
        self.state = TraceState.RECORDING
        self.order = []
        self.deviated = False
        self._distances = {}

    def start_forward(self) -> None:
        """The root module's forward begins."""
        if self.state is TraceState.RECORDING:
            self.order = []
            self._distances = {}
        self.position = 0

    def visit(self, module: nn.Module) -> Optional[int]:
        """Note that ``module`` runs now; its trace position when the trace is valid and followed. A module
        found further on means this rank skipped the ones in between (a layer drop, a branch): their positions
        are in ``take_skipped()``, so the runtime can issue their collectives as the other ranks do."""
        if self.state is TraceState.RECORDING:
            self.order.append(module)
            return None
        if self.deviated:
            return None
        if self.position < len(self.order) and self.order[self.position] is module:
            self.position += 1
            return self.position - 1
        ahead = next((i for i in range(self.position, len(self.order)) if self.order[i] is module), None)
        if ahead is None:
            self.deviated = True
            return None
        self._skipped = list(range(self.position, ahead))
        self.position = ahead + 1
        return ahead

    def take_skipped(self) -> list[int]:
        """Positions the last visit jumped over (this rank did not run those modules)."""
        skipped, self._skipped = self._skipped, []
        return skipped

    @property
    def following(self) -> bool:
        return self.state is TraceState.VALID and not self.deviated

    def end_step(self) -> None:
        """At the end of a step (all ranks together): validate a recording, or go back to recording."""
        if self.state is TraceState.RECORDING and self.order:
            self._check_same_on_all_ranks()
            self.state = TraceState.VALID
        elif self.deviated:
            self.state = TraceState.RECORDING
        self.deviated = False

    def _check_same_on_all_ranks(self) -> None:
        mine = [self._index[m] for m in self.order]
        everyone = all_gather_json(mine, self.comm.topology.group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise RuntimeError(self._describe_mismatch(mine, theirs, rank))

    def _describe_mismatch(self, mine: list, theirs: list, rank: int) -> str:
        names = list(self.module_names.values())
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        here = names[mine[at]] if at < len(mine) else "<end of forward>"
        there = names[theirs[at]] if at < len(theirs) else "<end of forward>"
        return (
            f"ZeRO stage 3: ranks ran their modules in different orders: at position {at} rank "
            f"{self.comm.topology.rank} ran '{here}' but rank {rank} ran '{there}'. Every rank must take the same "
            "code path through the model in a step (data-dependent branches must agree across ranks)."
        )

    def reuse_distance(self, position: int, unit, units_for: Callable, backward_follows: bool) -> float:
        """Elements gathered between the forward at ``position`` and the next use of ``unit`` (this forward's
        remaining modules, then, when a backward follows, backward in reverse order); infinity if none."""
        modules = lambda: self.order[position + 1 :] + (self.order[::-1] if backward_follows else [])
        return self._distance((position, id(unit), backward_follows), modules, unit, units_for)

    def backward_reuse_distance(self, position: int, unit, units_for: Callable) -> float:
        """Elements gathered between the backward of the module at ``position`` and the next use of ``unit`` in
        the same backward (the modules before ``position``, in reverse); infinity if none."""
        return self._distance((position, id(unit), "backward"), lambda: self.order[:position][::-1], unit, units_for)

    def _distance(self, key: tuple, modules: Callable, unit, units_for: Callable) -> float:
        """Elements of the units of ``modules()`` run before the first that uses ``unit``, cached under ``key``."""
        if key not in self._distances:
            distance = 0
            self._distances[key] = float("inf")
            for module in modules():
                units = units_for(module)
                if unit in units:
                    self._distances[key] = distance
                    break
                distance += sum(u.numel for u in units)
        return self._distances[key]

    def upcoming(self, position: int, backward: bool) -> list[nn.Module]:
        """Modules after ``position`` in execution order (before it, reversed, for backward)."""
        if backward:
            return self.order[:position][::-1]
        return self.order[position + 1 :]
