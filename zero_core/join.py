"""Uneven inputs: ``with engine.join(): ...`` lets ranks that run out of batches join the others' steps.

``torch.distributed.algorithms.Join`` semantics, as DistributedDataParallel has them: each step, a rank that
still has data tells the join context so (one tiny all-reduce before its first forward of the step); a rank
that has left its loop runs a *joined-rank step* for every step the others still take, issuing the same
collectives with a zero gradient (the runtime's ``joined_pass``), until every rank is done. Gradients are
averaged over the whole world (DDP's default, ``divide_by_initial_world_size=True``), so a joined rank
contributes zero. Unlike DDP, a joined rank also runs the optimizer step: under ZeRO it owns a shard of the
weights and optimizer state, so its step is part of everyone's. docs/core-api.md describes the limits (one
forward and backward per step inside join()).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from zero_core.engine import ZeroEngine


class EngineJoinable(Joinable):
    """The engine as a ``Joinable``: notifies the context at each step, runs joined-rank steps once joined."""

    def __init__(self, engine: "ZeroEngine") -> None:
        super().__init__()
        self.engine = engine
        self._notified_step = -1

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinedRankStep(self.engine)

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


class _JoinedRankStep(JoinHook):
    def __init__(self, engine: "ZeroEngine") -> None:
        self.engine = engine

    def main_hook(self) -> None:
        """One step of the ranks that still have data, with a zero gradient from this one."""
        self.engine.zero_grad()  # the joined rank's zero gradients are reduced into clean shards
        self.engine.runtime.joined_pass()  # the step's forward and backward collectives, as the runtime issues them
        self.engine.expect_gradients_from_other_ranks()
        self.engine.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        pass  # every rank stepped every step: weights and optimizer state already agree


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
