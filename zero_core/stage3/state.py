"""Stage 3's runtime state, typed: what one backward records, and which gathered units are in use.

The runtime (runtime.py) owns one of each and is the only code that changes them. Each is replaced or reset by
one call at its boundary instead of attribute by attribute. The hooks read them through one attribute of the
runtime; nothing here is constructed per hook call. The runtime's other state lives in objects with their own
verbs: the prefetch cursors (prefetch.py), the agreed reduce order (divergence.py) and a generation session's
keeping (generation_keeping.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from zero_core.stage3.coalesced import ReduceBucket
    from zero_core.stage3.param_unit import ParamUnit


def _counter() -> defaultdict:
    return defaultdict(int)


@dataclass(slots=True, eq=False)
class BackwardState:
    """What the runtime records from the forwards before a backward to that backward's end; the runtime replaces
    it whole when the backward ends (``PartitionedParamsRuntime._end_backward``). [Note: one reduce order]
    (divergence.py) says how ``reduce_cursor``, ``skipped_units`` and ``block_complete`` decide when a unit is
    reduce-scattered."""

    cursor: int  # backward: the trace position the next module's backward is looked for from, walking down
    seen: defaultdict = field(default_factory=_counter)  # unit -> gradients accumulated in this backward
    reduced: set = field(default_factory=set)  # units staged for reduce-scatter in this backward
    touched: set = field(default_factory=set)  # units of modules that ran forward on this rank
    skipped_positions: set = field(default_factory=set)  # trace positions this rank skipped in those forwards
    skipped_units: set = field(default_factory=set)  # their units, once backward passed their place
    reduce_cursor: int = 0  # the next unit of the agreed reduce order to reduce-scatter
    wanted_counts: dict = field(default_factory=dict)  # unit -> its parameters taking part (``wanted``)
    block_complete: set = field(default_factory=set)  # units of blocks whose backward is over
    block_missing: list = field(default_factory=list)  # parameters those reductions found without a gradient
    open_blocks: defaultdict = field(default_factory=_counter)  # block -> its forwards whose backward is to come
    bucket: Optional["ReduceBucket"] = None  # units staged for the next coalesced reduce-scatter

    def wanted(self, unit: "ParamUnit") -> int:
        """How many of ``unit``'s parameters take part in this backward (``active_count``, read once per unit)."""
        count = self.wanted_counts.get(unit)
        if count is None:
            count = self.wanted_counts[unit] = unit.active_count()
        return count


@dataclass(slots=True, eq=False)
class UnitUse:
    """Which gathered units are in use now, and so must not be released: counts of open forwards, units held to
    the end of the backward (returned parameters, reads outside a module), and the trace position of each open
    forward call (for the reuse rule at its end)."""

    active: defaultdict = field(default_factory=_counter)  # unit -> forwards now open that use it
    held: set = field(default_factory=set)  # units kept gathered until the step's backward ends
    positions: defaultdict = field(default_factory=lambda: defaultdict(list))  # module -> positions, innermost last

