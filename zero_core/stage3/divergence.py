"""Stage 3 with ranks whose forward differs: the collectives stay in one order that every rank agreed on.

[Note: skipped modules] When a rank skips a module that the others run (a layer drop, an ``if`` on the data,
an unused expert), it still issues that module's collectives where the agreed execution trace has them: its
gathers in forward and backward (the runtime's ``_gather_skipped_forward`` and ``_gather_skipped_backward``
mirror what the other ranks' hooks do there), and its gradient reduce-scatter, which contributes zeros. The
result is DistributedDataParallel's with ``find_unused_parameters=True``: the skipping rank adds a zero gradient
to the average. docs/stage3.md lists the divergences this covers; the others are caught by the collective
guard (zero_core/comm/guard.py).

[Note: one reduce order] Once the trace is agreed, gradients are reduce-scattered in one order fixed by it
(``ReduceOrder``), not in the order a rank's autograd happens to finish them, so a rank's missing module can
never pair its reduce-scatter with another module's, and every rank fills the same coalesced buckets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

if TYPE_CHECKING:
    from zero_core.stage3.param_unit import ParamUnit
    from zero_core.stage3.state import BackwardState


def units_in_reduce_order(trace_order: list[nn.Module], units_for: Callable, trainable: list["ParamUnit"]
                          ) -> list["ParamUnit"]:
    """Trainable units in the order backward finishes them on a rank that runs the whole trace: by their first
    use in forward, last first; units the trace never uses come after, in reverse model order."""
    first_use, seen = [], set()
    for module in trace_order:
        for unit in units_for(module):
            if unit.trainable and unit not in seen:
                seen.add(unit)
                first_use.append(unit)
    return first_use[::-1] + [unit for unit in reversed(trainable) if unit not in seen]


class ReduceOrder:
    """The agreed reduce order ([Note: one reduce order]) and the bucket widths planned along it. ``units`` is
    None while the trace is recorded (the collectives are checked one by one then, and units go as they come)."""

    __slots__ = ("units", "_source", "_widths_for", "_widths", "_index")

    def __init__(self) -> None:
        self.units: Optional[list["ParamUnit"]] = None
        self._source: Optional[list[nn.Module]] = None  # the trace order ``units`` was derived from
        self._widths_for: Optional[list["ParamUnit"]] = None  # the order ``_widths`` were planned along
        self._widths: dict["ParamUnit", int] = {}
        self._index: dict["ParamUnit", int] = {}

    def forget(self) -> None:
        """The trace is recorded again: no agreed order until it is valid."""
        self.units = None

    def follow(self, trace_order: list[nn.Module], units_for: Callable, trainable: list["ParamUnit"]) -> None:
        """The trace is valid: derive the order from it, unless it is the trace already followed."""
        if self.units is None or self._source is not trace_order:
            self.units, self._source = units_in_reduce_order(trace_order, units_for, trainable), trace_order

    def rebuild(self, trace_order: list[nn.Module], units_for: Callable, trainable: list["ParamUnit"]) -> None:
        """The units changed (add_trainable): the order names the new ones, along the same trace."""
        if self.units is not None:
            self.units = units_in_reduce_order(trace_order, units_for, trainable)

    def launch_ready(self, state: "BackwardState", reduce: Callable[["ParamUnit"], list[str]]) -> None:
        """``reduce`` every unit whose turn has come and whose gradients are complete on this rank. A unit only of
        modules this rank skipped gets no gradient here: it goes with zeros once backward has passed the skipped
        module's place, which is where the other ranks reduce it."""
        order = self.units
        while state.reduce_cursor < len(order):
            unit = order[state.reduce_cursor]
            if unit not in state.reduced and state.wanted(unit):
                skipped = unit in state.skipped_units and unit not in state.touched
                complete = skipped or unit in state.block_complete or state.seen[unit] >= state.wanted(unit)
                if not complete:
                    return
                missing = reduce(unit)
                if not skipped and unit in state.block_complete:  # a parameter of the block got no gradient
                    state.block_missing += missing
            state.reduce_cursor += 1

    def remaining(self, state: "BackwardState") -> list["ParamUnit"]:
        """The units the order has not reached yet in this backward."""
        return self.units[state.reduce_cursor:]

    def planned_width(self, unit: "ParamUnit", world: int, per_rank: int, limit: int) -> Optional[int]:
        """The columns of the bucket that ``unit`` opens: the units that follow it in the order and will join it
        (same dtype, within ``per_rank`` columns, until the bucket holds ``limit`` elements), so that a bucket
        is sent as filled. None for a unit the order does not name."""
        order = self.units
        if self._widths_for is not order:  # the order changed: plan again
            self._widths.clear()
            self._widths_for = order
            self._index = {u: i for i, u in enumerate(order)}
        width = self._widths.get(unit)
        if width is None:
            index = self._index.get(unit)
            if index is None:
                return None
            width = 0
            for member in order[index:]:
                if member.dtype != unit.dtype or width + member.layout.shard_numel > per_rank:
                    break
                width += member.layout.shard_numel
                if width * world >= limit:
                    break
            self._widths[unit] = width = max(width, unit.layout.shard_numel)
        return width


def leaf_hint(model: nn.Module, module: nn.Module) -> str:
    """Ranks ran different modules at ``module``: name the enclosing modules one of which should be declared a
    leaf (its subtree then gathers as one unit, whatever children a rank runs)."""
    names = {m: n for n, m in model.named_modules()}
    name = names.get(module, "")
    parts = name.split(".") if name else []
    candidates = []
    for depth in range(len(parts) - 1, -1, -1):
        ancestor = model.get_submodule(".".join(parts[:depth]))
        if not isinstance(ancestor, (nn.ModuleList, nn.ModuleDict)):
            candidates.append(f"'{'.'.join(parts[:depth]) or '<root>'}' ({type(ancestor).__name__})")
    return ("If ranks run different submodules here on purpose (a mixture-of-experts block that skips experts "
            "without tokens), declare the module that chooses them a leaf before setup, so its subtree is "
            f"gathered as one unit: one of {', '.join(candidates[:3]) or 'its parent modules'}, with "
            "zero_core.set_z3_leaf_modules(model, [ItsClass]) or zero_optimization.leaf_module "
            "{'names': [...]} (docs/stage3.md, leaf modules).")
