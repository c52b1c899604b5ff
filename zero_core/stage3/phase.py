"""Where stage 3 stands in a training step, checked at each transition.

The trace's step (execution_trace.py) ends at the next root forward after the optimizer step (a step can come in
the middle of a root forward's work: several optimizers in one Lightning training_step), or at the step itself
when the model is driven through its submodules and no root forward runs. A backward returns to the phase it
started from. The transitions below are the only ones the runtime makes; anything else is a bug in the engine,
reported with both phases instead of silently mixing two steps' bookkeeping.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    IDLE = "idle"  # no root forward in this trace step yet
    FORWARD = "forward"  # a root forward ran in this trace step (training, eval, no_grad or generate)
    BACKWARD = "backward"  # autograd's backward runs; the end-of-backward flush is queued
    STEPPED = "stepped"  # the optimizer stepped after a root forward: the trace step ends at the next root forward


# phase -> phases it may move to
ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.BACKWARD}),
    Phase.FORWARD: frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.STEPPED}),
    # the end of a backward goes back to where it started
    Phase.BACKWARD: frozenset({Phase.IDLE, Phase.FORWARD, Phase.STEPPED}),
    Phase.STEPPED: frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.STEPPED}),
}


def checked(current: Phase, new: Phase) -> Phase:
    """``new``, once it is known to be a transition the runtime may make from ``current``."""
    if new not in ALLOWED[current]:
        raise RuntimeError(
            f"ZeRO stage 3: the runtime moved from phase '{current.value}' to '{new.value}', which no training "
            "step does (a bug in the engine: please report it with the code that drives the model)"
        )
    return new
