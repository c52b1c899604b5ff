"""Stage 3 gradient side: per-parameter gradient hooks, staging into reduce buckets, the coalesced
reduce-scatters in flight, and the end-of-backward flush.

``GradientReduction`` is a part of ``PartitionedParamsRuntime`` (runtime.py), written as a mixin over the
runtime's typed state: what it needs of the runtime is ``GradientReductionHost``. The per-backward record is one
``BackwardState`` (state.py), replaced whole by ``_end_backward``; the reduction queue ``_inflight`` and the
``session`` (zero_core/reduction.py) are created by the runtime's constructor. Once the trace is agreed, units are
reduced in the fixed order of ``ReduceOrder`` ([Note: one reduce order], divergence.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from zero_core.planning import reduce_bucket_numel
from zero_core.reduction import unused_parameters_message
from zero_core.stage3.coalesced import CoalescedReduce, ReduceBucket
from zero_core.stage3.param_unit import ParamUnit
from zero_core.stage3.partitioned_param import unguarded
from zero_core.stage3.phase import Phase
from zero_core.stage3.state import BackwardState
from zero_core.weak_hooks import weakly

if TYPE_CHECKING:
    from zero_core.buffer_pool import BufferPool
    from zero_core.comm.communicator import Communicator
    from zero_core.config import ZeroConfig
    from zero_core.reduction import BackwardSession, ReductionQueue
    from zero_core.stage3.divergence import ReduceOrder
    from zero_core.stage3.execution_trace import ExecutionTrace
    from zero_core.stage3.policy import Stage3Policy
    from zero_core.stage3.prefetch import Prefetcher
    from zero_core.stage3.state import UnitUse
    from zero_core.stage3.streams import SideStreams


@runtime_checkable
class GradientReductionHost(Protocol):
    """What ``GradientReduction`` reads and calls on the runtime it is part of."""

    parts: list[ParamUnit]
    config: "ZeroConfig"
    comm: "Communicator"
    policy: "Stage3Policy"
    pool: "BufferPool"
    streams: "SideStreams"
    trace: "ExecutionTrace"
    session: "BackwardSession"
    phase: Phase
    _resume_phase: Phase  # the phase a backward returns to
    backward: BackwardState
    use: "UnitUse"
    prefetch: "Prefetcher"
    reduce_order: "ReduceOrder"
    _inflight: "ReductionQueue"
    _deferred: set[ParamUnit]  # units inside leaf modules: reduced at the end of backward, in order
    _blocks: set[nn.Module]
    _tiles: set[nn.Module]
    _module_of: dict[ParamUnit, nn.Module]
    _own: dict[nn.Module, list[ParamUnit]]
    _release: Callable[[ParamUnit], None]
    release_all: Callable[[], None]
    _to: Callable[[Phase], None]
    _begin_backward_phase: Callable[[], None]


class GradientReduction:
    """Gradient reduction for ``PartitionedParamsRuntime``: its verbs are ``_reduce`` (stage a unit's gradients
    into the bucket), ``_flush_bucket`` (reduce-scatter the bucket) and ``_finish_backward`` (the end-of-backward
    flush); the hooks call ``_on_grad`` and ``_block_backward_done``. Needs ``GradientReductionHost``."""

    def _hook_grads(self, units: list[ParamUnit]) -> None:
        """A post-accumulate-grad hook per parameter, for the units whose gradients nothing else completes. A
        block's units need none: the block's post-backward hook completes them all at once (block_units.py), and
        when it cannot fire (the block's input needs no gradient, reentrant checkpointing) the end-of-backward
        flush reduces them, in the same agreed order. That saves a Python call per parameter per backward."""
        for unit in units:
            if self._module_of[unit] in self._blocks:
                continue
            for param in unit.params:
                param.register_post_accumulate_grad_hook(weakly(self._on_grad, unit))

    def _block_backward_done(self, block: nn.Module) -> None:
        """Every gradient this backward gives the block's own units has been accumulated by now (autograd runs
        gradient accumulation before the nodes that consume the block's input gradients): what is still missing
        belongs to a child that did not run on this rank; it goes with zeros, where the other ranks reduce it."""
        if not self.session.sync:
            return
        state = self.backward
        for unit in self._own.get(block, []):
            if unit.trainable and state.wanted(unit) and unit not in self._deferred:
                state.block_complete.add(unit)
        if self.reduce_order.units is not None:
            self.reduce_order.launch_ready(state, self._reduce)
            return
        for unit in self._own.get(block, []):
            if unit in state.block_complete and unit not in state.reduced:
                state.block_missing += self._reduce(unit)

    def _end_backward(self) -> None:
        """A backward is over (flushed at its end, or at the end of a joined-rank step): start the next one's
        record, and return to the phase the backward started from."""
        self.backward = BackwardState(cursor=len(self.trace.order) - 1)
        if self.phase is Phase.BACKWARD:
            self._to(self._resume_phase)
        self.session.close()
        self.session.unsynced_grads = False
        self.prefetch.restart_backward()

    def _enter_backward(self) -> None:
        """A module's backward (or a gradient) arrived: the phase is BACKWARD and the flush is queued."""
        self._begin_backward_phase()
        self.session.begin()

    def _on_grad(self, unit: ParamUnit, param: nn.Parameter) -> None:
        if not self.session.grad_arrived():
            return  # no_sync: autograd keeps accumulating in param.grad
        self._enter_backward()
        state = self.backward
        state.seen[unit] += 1
        if unit in self._deferred or state.seen[unit] < state.wanted(unit):
            return  # an incomplete unit unblocks nothing
        if self._module_of[unit] in self._tiles and self.use.active[unit] == 0 and unit not in self.use.held:
            # A tile's backward is over once its gradients are in (they come after its input's): released here
            # too, for a tile whose input needs no gradient and so has no post-backward hook (tile_units.py).
            self._release(unit)
        if self.reduce_order.units is not None:
            self.reduce_order.launch_ready(state, self._reduce)
        elif unit not in state.reduced:
            self._reduce(unit)

    def _bucket_numel(self) -> int:
        """Elements of a coalesced reduce-scatter, as planning.py sizes it."""
        return reduce_bucket_numel([u.numel for u in self.parts], self.config)

    def _reduce(self, unit: ParamUnit) -> list[str]:
        """Stage ``unit``'s gradients into the reduction bucket (freeing ``param.grad``); a full bucket is
        reduce-scattered in one collective. Every rank fills buckets in the same unit order (the agreed reduce
        order), so their collectives pair up."""
        state = self.backward
        state.reduced.add(unit)
        if state.bucket is not None and (state.bucket.buffer.dtype != unit.dtype or not state.bucket.fits(unit)):
            self._flush_bucket()
        if state.bucket is None:
            buffer = self.pool.acquire(self.pool.largest, unit.dtype, zeroed=False)
            state.bucket = ReduceBucket(buffer, self.comm.topology.world_size, self._planned_width(unit))
        missing = state.bucket.add(unit)
        unit.reduced_whole = not missing  # every parameter had a gradient here (offload's early step reads it)
        # While the collectives are checked (the first trace is recorded, when ranks' orders may still differ),
        # each unit goes alone, so that a mismatch is caught and named by its module. A bucket that holds all
        # it was planned for goes at once, without waiting for the unit that does not fit.
        bucket = state.bucket
        if (bucket.filled * bucket.world >= min(self.policy.reduce_bucket_size, self.pool.largest)
                or bucket.filled == bucket.per_rank or self.comm.check):
            self._flush_bucket()
        return missing

    def _planned_width(self, unit: ParamUnit) -> Optional[int]:
        """The columns of the bucket that ``unit`` opens: the units that follow it in the agreed reduce order and
        will join it under ``_reduce``'s rules, so a bucket is sent as filled, with no rows to close up
        (``ReduceBucket.send``). None (a full bucket's width) while there is no agreed order, or while units go
        alone. A unit that does not come (frozen for this backward) leaves the bucket partly filled: still
        correct, closed up as before."""
        if self.reduce_order.units is None or self.comm.check:
            return None
        world = self.comm.topology.world_size
        largest = self.pool.largest
        return self.reduce_order.planned_width(unit, world, largest // world,
                                               min(self.policy.reduce_bucket_size, largest))

    def _flush_bucket(self) -> None:
        state = self.backward
        if state.bucket is None:
            return
        batch = CoalescedReduce(state.bucket, self.comm, async_op=self.policy.overlap_comm,
                                stream=self.streams.reduce)
        self._inflight.push((batch, state.bucket.buffer))
        state.bucket = None

    def _complete_reduction(self, job: tuple[CoalescedReduce, torch.Tensor]) -> None:
        """The reduction queue's oldest reduce-scatter: wait, add into the gradient shards, free its bucket."""
        batch, staging = job
        batch.finish()
        for unit in batch.units:
            if unit.on_grad_reduced is not None:  # offload: copy the reduced shard to the host now
                unit.on_grad_reduced(unit, None)
        self.pool.release(staging)

    def _complete_inflight(self) -> None:
        """Wait for every reduce-scatter in flight."""
        self._inflight.drain()

    def _finish_backward(self, only: Optional[set] = None) -> None:
        """End of backward: reduce what no hook completed (fixed order), wait, release every gathered unit.
        Under no_sync nothing is reduced: the gradients wait in ``param.grad`` for the next synced backward.
        Units none of whose parameters requires a gradient now (frozen for this backward) wait too.
        ``only``: flush just these units (one optimizer's step), whatever their requires_grad."""
        state = self.backward
        unused, pending = list(state.block_missing), self.session.unsynced_grads and not self.session.sync
        if self.session.sync:
            order = self.reduce_order.units
            for unit in order if order is not None else reversed(self.parts):
                skip = unit not in only if only is not None else state.wanted(unit) == 0
                if unit not in state.reduced and not skip:
                    unused += self._reduce(unit)
            self._flush_bucket()
            self._complete_inflight()
        self.use.active.clear()  # a recomputation that stopped early left no open forward behind
        self.release_all()
        self._end_backward()
        with unguarded():
            self.session.unsynced_grads = pending or any(p.grad is not None for u in self.parts for p in u.params)
        if unused and not self.policy.ignore_unused_parameters:
            self.comm.guard.fail(  # raised on every rank: the others would otherwise wait for this one
                f"rank {self.comm.topology.rank}: {unused_parameters_message(unused)}", RuntimeError)
