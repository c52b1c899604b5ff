"""Uneven inputs: ``with engine.join(): ...`` lets ranks that run out of batches shadow the others' steps.

``torch.distributed.algorithms.Join`` semantics, as DistributedDataParallel has them: each step, a rank that
still has data tells the join context so (one tiny all-reduce before its first forward of the step); a rank
that has left its loop runs a *shadow step* for every step the others still take, issuing the same collectives
with a zero gradient, until every rank is done. Gradients are averaged over the whole world (DDP's default,
``divide_by_initial_world_size=True``), so a joined rank contributes zero. Unlike DDP, a joined rank also runs
the optimizer step: under ZeRO it owns a shard of the weights and optimizer state, so its step is part of
everyone's. docs/core-api.md describes the limits (one forward and backward per step inside join()).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from zero_core.stage3.divergence import launch_in_order, skipped_backward, skipped_forward

if TYPE_CHECKING:
    from zero_core.engine import ZeroEngine


class EngineJoinable(Joinable):
    """The engine as a ``Joinable``: notifies the context at each step, shadows steps once joined."""

    def __init__(self, engine: "ZeroEngine") -> None:
        super().__init__()
        self.engine = engine
        self._notified_step = -1

    def join_hook(self, **kwargs) -> JoinHook:
        return _ShadowStep(self.engine)

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self):
        return self.engine.topology.group or dist.group.WORLD

    def attach(self):
        """Register the notify hook on the engine's module; returns its removable handle."""
        return self.engine.module.register_forward_pre_hook(self.notify, prepend=True)

    def notify(self, module, args) -> None:
        """Forward pre-hook: the first forward of each step tells the join context this rank has data."""
        step = self.engine.comm.guard.step
        if step != self._notified_step:
            self._notified_step = step
            Join.notify_join_context(self)


class _ShadowStep(JoinHook):
    def __init__(self, engine: "ZeroEngine") -> None:
        self.engine = engine

    def main_hook(self) -> None:
        """One step of the ranks that still have data, with a zero gradient from this one."""
        runtime = self.engine.runtime
        self.engine.zero_grad()  # the shadow's zero gradients are reduced into clean shards
        if self.engine.config.stage == 3:
            _shadow_stage3_pass(runtime)
        elif self.engine.config.stage == 2:
            _shadow_stage2_backward(runtime.reducer)
        for pending in self.engine._pending:
            pending.saw_grad = True  # the others' gradients arrive in this rank's shards
        self.engine.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        pass  # every rank stepped every step: weights and optimizer state already agree


def _shadow_stage2_backward(reducer) -> None:
    """Stage 2 reduces every bucket in backward, last first: the same buckets, holding zeros."""
    reducer._count_expected()
    reducer.finish_backward()


def _shadow_stage3_pass(runtime) -> None:
    """Stage 3: the forward and backward of a rank that skipped every module of the agreed trace."""
    if runtime.trace.state.value != "valid":
        raise RuntimeError(
            "engine.join(): this rank ran out of batches before stage 3 agreed on its execution trace (the first "
            "step); every rank needs at least one full step before it can shadow the others"
        )
    runtime._root_pre_forward(runtime.module, ())
    order = runtime.trace.order
    # A hooked root (its own units, or the root group: root_group.py) is at position 0 and open through the
    # forward; after it, its units stay for the backward or go as its post-forward decides; its backward comes
    # first (a prefetch from the end of the trace), before the modules' in reverse order.
    root = runtime._units_for(runtime.module) if order and order[0] is runtime.module else []
    for unit in root:
        runtime._active[unit] += 1
    for position in range(len(order)):
        skipped_forward(runtime, position)
    runtime.trace.position = len(order)
    for unit in root:
        runtime._active[unit] -= 1
        if not runtime._root_keeps(True, unit) and not runtime._reused_soon(0, unit, True):
            runtime._release(unit)
    runtime._in_backward = True
    if root:
        runtime._fetch(root, len(order), backward=True)
        runtime._skipped_units.update(root)
    for position in reversed(range(1 if root else 0, len(order))):
        skipped_backward(runtime, position)
    launch_in_order(runtime)
    for unit in runtime._reduce_order[runtime._reduce_cursor:]:
        if unit not in runtime._reduced and unit.active_count():
            runtime._reduce(unit)  # units no trace position holds: reduced last, as at the end of a backward
    runtime._flush_bucket()  # the last, partly filled reduction bucket, as _finish_backward sends it
    runtime._complete_inflight()
    runtime._active.clear()
    runtime.release_all()
    runtime._reset_backward_state()
    runtime.session.unsynced_grads = False


@contextlib.contextmanager
def attached_joinable(engine: "ZeroEngine") -> Iterator[EngineJoinable]:
    """The engine as a ``Joinable`` for a ``Join`` the caller builds (e.g. with other joinables, as Accelerate's
    ``join_uneven_inputs`` does); it notifies the context at each step while this block lasts."""
    joinable = EngineJoinable(engine)
    handle = joinable.attach()
    try:
        yield joinable
    finally:
        handle.remove()


def join_context(engine: "ZeroEngine", enable: bool = True, throw_on_early_termination: bool = False) -> Join:
    """``torch.distributed.algorithms.Join`` over the engine; see :meth:`ZeroEngine.join`."""
    joinable = EngineJoinable(engine)
    handle = joinable.attach()
    return _JoinWithHook(joinable, handle, enable, throw_on_early_termination)


class _JoinWithHook(Join):
    """Join that removes the engine's notify hook when it ends."""

    def __init__(self, joinable: EngineJoinable, handle, enable: bool, throw_on_early_termination: bool) -> None:
        super().__init__([joinable], enable=enable, throw_on_early_termination=throw_on_early_termination)
        self._handle = handle

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._handle.remove()
