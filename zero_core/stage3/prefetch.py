"""Stage 3 prefetch: which sharded units to gather ahead of use, and which gathered ones to keep.

``Prefetcher`` is the runtime's ``prefetch`` (runtime.py): it owns the cursors into the agreed execution trace
(execution_trace.py), one per direction, and the rules that read the trace: the next batch to gather
(``prefetch_bucket_size``, ``max_live_parameters``) and whether a unit is reused soon enough to stay gathered
(``max_reuse_distance``). The runtime hands it the elements gathered now with each question; gathering and
releasing themselves (``_fetch``, ``_release``, live-element accounting) stay in the runtime. docs/stage3.md
explains the knobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from zero_core.stage3.param_unit import ParamUnit, UnitState

if TYPE_CHECKING:
    from zero_core.comm.communicator import Communicator
    from zero_core.stage3.execution_trace import ExecutionTrace
    from zero_core.stage3.policy import Stage3Policy


class TraceCursor:
    """Where prefetch stands in the trace for one direction: the next position to look at (``next``), the position
    whose module takes the next batch (``trigger``), and the position of the last call (``last``; one not ahead
    of it starts a new pass)."""

    __slots__ = ("next", "trigger", "last")

    def __init__(self) -> None:
        self.next, self.trigger, self.last = 0, 0, None


class Prefetcher:
    """Gather-ahead and keep-gathered decisions along the agreed trace: ``next_batch`` (what to unshard with a
    module's units), ``root_keeps`` and ``reused_soon`` (whether a unit stays unsharded). The backward cursor
    starts again with every backward (``restart_backward``)."""

    __slots__ = ("trace", "policy", "comm", "units_for", "tiles", "forward", "backward")

    def __init__(self, trace: "ExecutionTrace", policy: "Stage3Policy", comm: "Communicator",
                 units_for: Callable[[nn.Module], list[ParamUnit]], tiles: set[nn.Module]) -> None:
        self.trace = trace
        self.policy = policy
        self.comm = comm  # its options say whether forward gathers are quantised (qwZ)
        self.units_for = units_for
        self.tiles = tiles  # a tile ends a batch: one tile is gathered ahead
        self.forward = TraceCursor()
        self.backward = TraceCursor()

    def restart_backward(self) -> None:
        self.backward = TraceCursor()

    def next_batch(self, position: int, backward: bool, taken: set, live_elements: int,
                   keep_budget: Optional[int]) -> list[ParamUnit]:
        """The sharded units of the modules that run next, up to ``prefetch_bucket_size`` elements, taken in trace
        order from a cursor (never rescanning the trace). The next batch is taken when the module that ends the
        previous one runs, so at most ``prefetch_bucket_size`` elements are gathered ahead of use. A generation
        session's ``keep_budget`` bounds the elements gathered too."""
        cursor = self.backward if backward else self.forward
        step = -1 if backward else 1
        if cursor.last is None or (position - cursor.last) * step <= 0:  # a new pass over the trace
            cursor.next, cursor.trigger = position + step, position
        cursor.last = position
        if (cursor.trigger - position) * step > 0:
            return []  # the previous batch is still ahead
        order, index = self.trace.order, cursor.next
        if (position + step - index) * step > 0:
            index = position + step
        budget, live, batch = self.policy.prefetch_bucket_size, live_elements, []
        max_live = self.policy.max_live_parameters
        if keep_budget is not None:  # a generation session (generation.py): its budget bounds prefetch too
            max_live = min(max_live, keep_budget)
        while 0 <= index < len(order):
            fits, module = True, order[index]
            for unit in self.units_for(module):
                if unit.state is not UnitState.SHARDED or unit in taken:
                    continue
                if unit.numel > budget or live + unit.numel > max_live:
                    fits = False
                    break
                budget -= unit.numel
                live += unit.numel
                taken.add(unit)
                batch.append(unit)
            if not fits:
                break  # this module's remaining units wait for the next batch
            index += step
            if module in self.tiles:
                break  # a tile ends the batch: tiling keeps one tile gathered ahead, whatever the budget
        cursor.next = index
        cursor.trigger = index - step if batch else index
        return batch

    def root_keeps(self, backward_follows: bool, unit: ParamUnit, live_elements: int) -> bool:
        """After the root's forward: keep its ``unit`` (the root group's included) for the backward that comes next,
        budget permitting (nothing is gathered in between, as FSDP2's root keeps its parameters), and within
        ``max_reuse_distance`` of the backward's start, so a run tuned for the least memory (0) still gathers the
        root's units again where the backward uses them. Not under qwZ, whose forward gathered int8 codes: there
        the reuse rule decides, as for any module, and a released unit is gathered exact for the backward."""
        if not backward_follows or live_elements > self.policy.max_live_parameters:
            return False
        if self.comm.options.quantize_weights:
            return False
        if not self.trace.following:  # the first step: no order to measure the distance on yet
            return self.policy.max_reuse_distance > 0
        end = len(self.trace.order) - 1  # from the end of the forward: the backward in reverse order
        return self.trace.reuse_distance(end, unit, self.units_for, True) <= self.policy.max_reuse_distance

    def reused_soon(self, position: Optional[int], unit: ParamUnit, live_elements: int,
                    backward_follows: Optional[bool] = None, in_backward: bool = False) -> bool:
        """``max_reuse_distance``: keep a unit that the trace says is needed again soon, budget permitting
        (``backward_follows``: grad mode, when the caller has not read it already; ``in_backward``: after the
        backward of the module at ``position``, looking at the rest of the backward: a tied embedding's unit,
        used by the head's backward, is kept for the embedding's)."""
        if position is None or not self.trace.following or live_elements > self.policy.max_live_parameters:
            return False
        if in_backward:
            distance = self.trace.backward_reuse_distance(position, unit, self.units_for)
            return distance <= self.policy.max_reuse_distance
        if backward_follows is None:
            backward_follows = torch.is_grad_enabled()
        distance = self.trace.reuse_distance(position, unit, self.units_for, backward_follows)
        return distance <= self.policy.max_reuse_distance
