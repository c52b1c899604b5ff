"""Stage 3 gradient side: per-parameter gradient hooks, staging into reduce buckets, the coalesced
reduce-scatters in flight, and the end-of-backward flush.

``GradientReduction`` is a mixin of ``PartitionedParamsRuntime`` (runtime.py). It owns the per-backward
bookkeeping (``_seen``, ``_reduced``, ``_touched``, ``_skipped_*``, ``_block_complete``, ``_block_missing``,
``_reduce_cursor``, ``_wanted_counts``, the open ``_bucket``), reset by ``_reset_backward_state``; the reduction
queue ``_inflight`` and the ``session`` (zero_core/reduction.py) are created by the runtime's constructor. Once the
trace is agreed, units are reduced in the fixed order of divergence.py (``launch_in_order``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from torch import nn

from zero_core.planning import reduce_bucket_numel
from zero_core.reduction import unused_parameters_message
from zero_core.stage3.coalesced import CoalescedReduce, ReduceBucket
from zero_core.stage3.divergence import launch_in_order
from zero_core.stage3.param_unit import ParamUnit
from zero_core.stage3.partitioned_param import unguarded
from zero_core.stage3.phase import Phase
from zero_core.stage3.prefetch import _Cursor
from zero_core.weak_hooks import weakly


class GradientReduction:
    """Gradient reduction for ``PartitionedParamsRuntime`` (a mixin: it reads the runtime's units, ``session``,
    ``pool``, ``comm``, ``policy``, ``streams``, ``trace`` and phase)."""

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
        for unit in self._own.get(block, []):
            if unit.trainable and self._wanted(unit) and unit not in self._deferred:
                self._block_complete.add(unit)
        if self._reduce_order is not None:
            launch_in_order(self)
            return
        for unit in self._own.get(block, []):
            if unit in self._block_complete and unit not in self._reduced:
                self._block_missing += self._reduce(unit)

    def _reset_backward_state(self) -> None:
        self._seen: dict[ParamUnit, int] = defaultdict(int)
        self._reduced: set[ParamUnit] = set()
        if self.phase is Phase.BACKWARD:
            self._to(self._resume_phase)
        self.session.close()
        self._bwd_cursor = len(self.trace.order) - 1
        self.session.unsynced_grads = False
        self._touched: set[ParamUnit] = set()  # units of modules that ran forward since the last backward
        self._skipped_positions: set[int] = set()  # trace positions this rank skipped in those forwards
        self._skipped_units: set[ParamUnit] = set()  # their units, once backward passed their place
        self._reduce_cursor = 0  # next unit of _reduce_order to reduce-scatter
        self._wanted_counts: dict[ParamUnit, int] = {}  # _wanted, for this backward
        self._block_complete: set[ParamUnit] = set()  # units of blocks whose backward is over (_block_backward_done)
        self._block_missing: list[str] = []  # parameters those reductions found without a gradient
        self._open_blocks.clear()
        self._bucket: Optional[ReduceBucket] = None  # units staged for the next coalesced reduce-scatter
        self._prefetch_state[True] = _Cursor()

    def _wanted(self, unit: ParamUnit) -> int:
        """How many of ``unit``'s parameters take part in this backward (``active_count``, read once per unit)."""
        count = self._wanted_counts.get(unit)
        if count is None:
            count = self._wanted_counts[unit] = unit.active_count()
        return count

    def _enter_backward(self) -> None:
        """A module's backward (or a gradient) arrived: the phase is BACKWARD and the flush is queued."""
        self._in_backward = True
        self.session.begin()

    def _on_grad(self, unit: ParamUnit, param: nn.Parameter) -> None:
        if not self.session.grad_arrived():
            return  # no_sync: autograd keeps accumulating in param.grad
        self._enter_backward()
        self._seen[unit] += 1
        if unit in self._deferred or self._seen[unit] < self._wanted(unit):
            return  # an incomplete unit unblocks nothing
        if self._module_of[unit] in self._tiles and self._active[unit] == 0 and unit not in self._held:
            # A tile's backward is over once its gradients are in (they come after its input's): released here
            # too, for a tile whose input needs no gradient and so has no post-backward hook (tile_units.py).
            self._release(unit)
        if self._reduce_order is not None:
            launch_in_order(self)
        elif unit not in self._reduced:
            self._reduce(unit)

    def _bucket_numel(self) -> int:
        """Elements of a coalesced reduce-scatter, as planning.py sizes it."""
        return reduce_bucket_numel([u.numel for u in self.parts], self.config)

    def _reduce(self, unit: ParamUnit) -> list[str]:
        """Stage ``unit``'s gradients into the reduction bucket (freeing ``param.grad``); a full bucket is
        reduce-scattered in one collective. Every rank fills buckets in the same unit order (the agreed reduce
        order), so their collectives pair up."""
        self._reduced.add(unit)
        if self._bucket is not None and (self._bucket.buffer.dtype != unit.dtype or not self._bucket.fits(unit)):
            self._flush_bucket()
        if self._bucket is None:
            buffer = self.pool.acquire(self.pool.largest, unit.dtype, zeroed=False)
            self._bucket = ReduceBucket(buffer, self.comm.topology.world_size, self._planned_width(unit))
        missing = self._bucket.add(unit)
        # While the collectives are checked (the first trace is recorded, when ranks' orders may still differ),
        # each unit goes alone, so that a mismatch is caught and named by its module. A bucket that holds all
        # it was planned for goes at once, without waiting for the unit that does not fit.
        bucket = self._bucket
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
        order = self._reduce_order
        if order is None or self.comm.check:
            return None
        widths = self._planned_widths
        if widths.get(None) is not order:  # the order changed: plan again
            widths.clear()
            widths[None] = order
            self._order_index = {u: i for i, u in enumerate(order)}
        width = widths.get(unit)
        if width is None:
            index = self._order_index.get(unit)
            if index is None:
                return None
            world = self.comm.topology.world_size
            per_rank, limit = self.pool.largest // world, min(self.policy.reduce_bucket_size, self.pool.largest)
            width = 0
            for member in order[index:]:
                if member.dtype != unit.dtype or width + member.layout.shard_numel > per_rank:
                    break
                width += member.layout.shard_numel
                if width * world >= limit:
                    break
            widths[unit] = width = max(width, unit.layout.shard_numel)
        return width

    def _flush_bucket(self) -> None:
        if self._bucket is None:
            return
        batch = CoalescedReduce(self._bucket, self.comm, async_op=self.policy.overlap_comm,
                                stream=self.streams.reduce)
        self._inflight.push((batch, self._bucket.buffer))
        self._bucket = None

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
        unused, pending = list(self._block_missing), self.session.unsynced_grads and not self.session.sync
        if self.session.sync:
            for unit in self._reduce_order if self._reduce_order is not None else reversed(self.parts):
                skip = unit not in only if only is not None else self._wanted(unit) == 0
                if unit not in self._reduced and not skip:
                    unused += self._reduce(unit)
            self._flush_bucket()
            self._complete_inflight()
        self._active.clear()  # a recomputation that stopped early left no open forward behind
        self.release_all()
        self._reset_backward_state()
        with unguarded():
            self.session.unsynced_grads = pending or any(p.grad is not None for u in self.parts for p in u.params)
        if unused and not self.policy.ignore_unused_parameters:
            self.comm.guard.fail(  # raised on every rank: the others would otherwise wait for this one
                f"rank {self.comm.topology.rank}: {unused_parameters_message(unused)}", RuntimeError)
