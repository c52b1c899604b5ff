"""Stage 3 prefetch: which sharded units to gather ahead of use, and which gathered ones to keep.

``Prefetch`` is a part of ``PartitionedParamsRuntime`` (runtime.py), written as a mixin over the runtime's typed
state: what it needs of the runtime is ``PrefetchHost``. It moves the prefetch cursors (``PrefetchCursors``,
state.py: one ``TraceCursor`` per direction) and holds the rules that read the agreed execution trace
(execution_trace.py): the next batch to gather (``prefetch_bucket_size``, ``max_live_parameters``) and whether a
unit is reused soon enough to stay gathered (``max_reuse_distance``). Gathering and releasing themselves
(``_start_gather``, ``_release``, live-element accounting) stay in runtime.py. docs/stage3.md explains the knobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from zero_core.stage3.param_unit import ParamUnit, UnitState

if TYPE_CHECKING:
    from zero_core.comm.communicator import Communicator
    from zero_core.stage3.execution_trace import ExecutionTrace
    from zero_core.stage3.policy import Stage3Policy
    from zero_core.stage3.state import GenerationState, PrefetchCursors


@runtime_checkable
class PrefetchHost(Protocol):
    """What ``Prefetch`` reads and calls on the runtime it is part of."""

    trace: "ExecutionTrace"
    policy: "Stage3Policy"
    comm: "Communicator"
    live_elements: int  # gathered elements now (max_live_parameters bounds them)
    param_swap: Optional[Any]  # offload_param nvme: reads ahead along the same trace
    prefetch_cursors: "PrefetchCursors"
    generation: "GenerationState"  # a session's budget bounds prefetch too
    _tiles: set[nn.Module]
    _units_for: Callable[[nn.Module], list[ParamUnit]]
    _start_gather: Callable[[list[ParamUnit], str], None]


class Prefetch:
    """Gather-ahead and keep-gathered decisions for ``PartitionedParamsRuntime``: ``_fetch`` (unshard a module's
    units and prefetch the next batch), ``_root_keeps`` and ``_reused_soon`` (whether a unit stays unsharded).
    Needs ``PrefetchHost``."""

    def _fetch(self, units: list[ParamUnit], position: Optional[int], backward: bool,
               phase: Optional[str] = None) -> None:
        """Gather a module's ``units`` and, following the trace from ``position``, the next prefetch batch, in one
        collective; return once ``units`` are gathered. ``phase`` (default: from ``backward``) is what the gather
        serves, for ZeRO++'s paths (hpZ serves backward gathers from the in-node copy)."""
        batch = list(dict.fromkeys(u for u in units if u.state is UnitState.SHARDED))
        if position is not None and self.trace.following:
            batch += self._next_prefetch(position, backward, set(batch))
        if self.param_swap is not None:  # offload_param nvme: read these shards, then the trace's next, ahead
            following = position is not None and self.trace.following
            self.param_swap.look_ahead(batch, self.trace.order if following else None, position, backward,
                                       self._units_for)
        self._start_gather(batch, phase or ("backward" if backward else "forward"))
        for unit in units:
            unit.wait()

    def _next_prefetch(self, position: int, backward: bool, taken: set) -> list[ParamUnit]:
        """The sharded units of the modules that run next, up to ``prefetch_bucket_size`` elements, taken in trace
        order from a cursor (never rescanning the trace). The next batch is taken when the module that ends the
        previous one runs, so at most ``prefetch_bucket_size`` elements are gathered ahead of use."""
        cursors = self.prefetch_cursors
        cursor = cursors.backward if backward else cursors.forward
        step = -1 if backward else 1
        if cursor.last is None or (position - cursor.last) * step <= 0:  # a new pass over the trace
            cursor.next, cursor.trigger = position + step, position
        cursor.last = position
        if (cursor.trigger - position) * step > 0:
            return []  # the previous batch is still ahead
        order, index = self.trace.order, cursor.next
        if (position + step - index) * step > 0:
            index = position + step
        budget, live, batch = self.policy.prefetch_bucket_size, self.live_elements, []
        max_live = self.policy.max_live_parameters
        keep_budget = self.generation.budget
        if keep_budget is not None:  # a generation session (generation.py): its budget bounds prefetch too
            max_live = min(max_live, keep_budget)
        while 0 <= index < len(order):
            fits, module = True, order[index]
            for unit in self._units_for(module):
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
            if module in self._tiles:
                break  # a tile ends the batch: tiling keeps one tile gathered ahead, whatever the budget
        cursor.next = index
        cursor.trigger = index - step if batch else index
        return batch

    def _root_keeps(self, backward_follows: bool, unit: ParamUnit) -> bool:
        """After the root's forward: keep its ``unit`` (the root group's included) for the backward that comes next,
        budget permitting (nothing is gathered in between, as FSDP2's root keeps its parameters), and within
        ``max_reuse_distance`` of the backward's start, so a run tuned for the least memory (0) still gathers the
        root's units again where the backward uses them. Not under qwZ, whose forward gathered int8 codes: there
        the reuse rule decides, as for any module, and a released unit is gathered exact for the backward."""
        if not backward_follows or self.live_elements > self.policy.max_live_parameters:
            return False
        if self.comm.options.quantize_weights:
            return False
        if not self.trace.following:  # the first step: no order to measure the distance on yet
            return self.policy.max_reuse_distance > 0
        end = len(self.trace.order) - 1  # from the end of the forward: the backward in reverse order
        return self.trace.reuse_distance(end, unit, self._units_for, True) <= self.policy.max_reuse_distance

    def _reused_soon(self, position: Optional[int], unit: ParamUnit, backward_follows: Optional[bool] = None,
                     in_backward: bool = False) -> bool:
        """``max_reuse_distance``: keep a unit that the trace says is needed again soon, budget permitting
        (``backward_follows``: grad mode, when the caller has not read it already; ``in_backward``: after the
        backward of the module at ``position``, looking at the rest of the backward: a tied embedding's unit,
        used by the head's backward, is kept for the embedding's)."""
        if position is None or not self.trace.following or self.live_elements > self.policy.max_live_parameters:
            return False
        if in_backward:
            distance = self.trace.backward_reuse_distance(position, unit, self._units_for)
            return distance <= self.policy.max_reuse_distance
        if backward_follows is None:
            backward_follows = torch.is_grad_enabled()
        distance = self.trace.reuse_distance(position, unit, self._units_for, backward_follows)
        return distance <= self.policy.max_reuse_distance
