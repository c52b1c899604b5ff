"""Stage 3 with ranks whose forward differs: the collectives stay in one order that every rank agreed on.

When a rank skips a module that the others run (a layer drop, an ``if`` on the data, an unused expert), it
still issues that module's collectives where the agreed execution trace has them: its gathers in forward and
backward (``skipped_forward``/``skipped_backward``, mirroring what the other ranks' hooks do there), and its
gradient reduce-scatter, which contributes zeros. Gradients are reduce-scattered in one order fixed by the
trace (``reduce_order``), not in the order a rank's autograd happens to finish them, so a rank's missing module
can never pair its reduce-scatter with another module's. The result is DistributedDataParallel's with
``find_unused_parameters=True``: the skipping rank adds a zero gradient to the average. docs/stage3.md lists
the divergences this covers; the others are caught by the collective guard (collective_guard.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_core.stage3.param_unit import ParamUnit
    from zero_core.stage3.runtime import PartitionedParamsRuntime


def reduce_order(runtime: "PartitionedParamsRuntime") -> list["ParamUnit"]:
    """Trainable units in the order backward finishes them on a rank that runs the whole trace: by their first
    use in forward, last first; units the trace never uses come after, in reverse model order."""
    first_use, seen = [], set()
    for module in runtime.trace.order:
        for unit in runtime._units_for(module):
            if unit.trainable and unit not in seen:
                seen.add(unit)
                first_use.append(unit)
    return first_use[::-1] + [unit for unit in reversed(runtime.parts) if unit not in seen]


def launch_in_order(runtime: "PartitionedParamsRuntime") -> None:
    """Reduce-scatter every unit whose turn has come and whose gradients are complete on this rank. A unit only
    of modules this rank skipped gets no gradient here: it goes with zeros once backward has passed the skipped
    module's place, which is where the other ranks reduce it."""
    order = runtime._reduce_order
    while runtime._reduce_cursor < len(order):
        unit = order[runtime._reduce_cursor]
        if unit not in runtime._reduced and runtime._wanted(unit):
            skipped = unit in runtime._skipped_units and unit not in runtime._touched
            complete = skipped or unit in runtime._block_complete or runtime._seen[unit] >= runtime._wanted(unit)
            if not complete:
                return
            missing = runtime._reduce(unit)
            if not skipped and unit in runtime._block_complete:  # a parameter of the block got no gradient
                runtime._block_missing += missing
        runtime._reduce_cursor += 1


def skipped_forward(runtime: "PartitionedParamsRuntime", position: int) -> None:
    """What another rank's hooks do for the module at ``position`` of the trace: gather its units, prefetch
    from there, then release what is not reused soon."""
    module = runtime.trace.order[position]
    runtime._skipped_positions.add(position)
    units = runtime._units_for(module)
    runtime._fetch(units, position, backward=False)
    for unit in units:
        if runtime._active[unit] == 0 and unit not in runtime._held and not runtime._reused_soon(position, unit):
            if runtime._keep_budget is None or not runtime.kept_for_generation(unit):  # as the ranks that ran it decide (generation.py)
                runtime._release(unit)


def skipped_backward(runtime: "PartitionedParamsRuntime", position: int) -> None:
    """The backward of a module this rank skipped: gather its units and prefetch as the others do, release."""
    units = runtime._units_for(runtime.trace.order[position])
    runtime._fetch(units, position, backward=True)
    for unit in units:
        if runtime._active[unit] == 0 and unit not in runtime._held:
            runtime._release(unit)
    runtime._skipped_units.update(units)
    if runtime._reduce_order is not None:
        launch_in_order(runtime)
