"""Gradient reduction for stages 1 and 2: buckets reduce-scattered into each rank's gradient shard.

Every rank reduces the buckets in one fixed order, last bucket first (the order backward produces them), so
the collectives match across ranks whatever the timing. A bucket none of whose parameters requires a gradient
at the time (frozen for this backward, e.g. the other optimizer's under Lightning's toggle_optimizer) is left
out of that backward; its step reduces whatever it holds. Stage 2 launches a bucket from a post-accumulate-grad
hook as soon as its gradients are in and every later bucket has been launched; a callback queued on the
autograd engine flushes the rest once backward ends. The bucket reduced last is reduced when the step needs it,
in place in a staging buffer it keeps, and its hooks run no Python (last_bucket.py). Stage 1 reduces every bucket
that way, once, when the step needs the gradients.
See docs/core-api.md for the full rules.
"""

from __future__ import annotations

import functools
import operator
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from zero_core.buffer_pool import BufferPool
from zero_core.planning import REPLICATED_IN_FLIGHT
from zero_core.comm.communicator import Communicator
from zero_core.reduction import BackwardSession, ReductionQueue, unused_parameters_message
from zero_core.replicated.flat_param_group import FlatParamGroup
from zero_core.replicated.last_bucket import LastBucketSlots


@dataclass
class _BucketState:
    """What one bucket has received during the current backward."""

    staging: Optional[torch.Tensor] = None
    views: Optional[dict] = None  # parameter index -> its slot in ``staging`` (GradReducer._open_staging)
    seen: set = field(default_factory=set)


@dataclass
class _InFlight:
    group: FlatParamGroup
    bucket: int
    work: Optional[dist.Work]
    result: torch.Tensor
    scratch: list
    accumulate: bool
    scale: float  # the result times this is the average (1/N unless the source was pre-divided)
    whole: bool = False  # every parameter of the bucket had a gradient here (offload's early step reads it)


class GradReducer:
    """Owns the bucket order, the stage 2 hooks and every gradient collective."""

    MAX_IN_FLIGHT = REPLICATED_IN_FLIGHT

    def __init__(
        self,
        groups: list[FlatParamGroup],
        comm: Communicator,
        pool: BufferPool,
        *,
        partition_grads: bool,
        overlap: bool,
        use_reduce_scatter: bool,
        ignore_unused: bool,
        model_position: dict,
    ) -> None:
        self.groups = groups
        self._params = [p for g in groups for p in g.params]
        self.comm = comm
        self.pool = pool
        self.partition_grads = partition_grads
        self.overlap = overlap
        self.use_reduce_scatter = use_reduce_scatter
        self.ignore_unused = ignore_unused
        self.world_size = comm.topology.world_size
        self.rank = comm.topology.rank
        # Global bucket order: position i is (group, bucket index); reduction runs from the end. Buckets are
        # sorted by where their parameters sit in the model, since backward produces gradients in roughly
        # reverse model order, across optimizer groups; so a completed bucket rarely waits for another.
        buckets = [(g, b.index) for g in groups for b in g.layout.buckets]
        self.order = sorted(buckets, key=lambda gb: min(
            (model_position[gb[0].params[i]] for i in gb[0].layout.buckets[gb[1]].param_indices), default=-1))
        self._bucket_params = [[g.params[i] for i in g.layout.buckets[b].param_indices] for g, b in self.order]
        # no_sync, waiting gradients and the end-of-backward flush (zero_core/reduction.py, shared with stage 3)
        self.session = BackwardSession(self.finish_backward, on_open=self._count_expected)
        self._inflight: ReductionQueue[_InFlight] = ReductionQueue(self._complete, self.MAX_IN_FLIGHT, overlap)
        self._views: dict = {}  # (position, staging buffer) -> each parameter's view of it, see _open_staging
        self._grad_notes = None
        self._notes_handles: list = []
        # Stage 2: the bucket reduced last keeps its staging, its slots its parameters' .grad (last_bucket.py)
        self._last = self._keep_last_staging() if partition_grads and self.order else None
        last_params = set(self._last.params) if self._last is not None else set()
        self._hooked_params = [p for p in self._params if p not in last_params]  # .grad None outside backward
        self.cleared_on_zero = {g: [p for p in g.params if p not in last_params] for g in groups}
        self._reset_backward_state()
        if partition_grads:
            self._register_hooks()

    @property
    def grad_notes(self):
        """The engine's GradNotes (stage 2, set by the runtime): each arriving gradient is recorded there, by
        the hook of its parameter (the last bucket's: by hooks of the notes' own, GradNotes.hook)."""
        return self._grad_notes

    @grad_notes.setter
    def grad_notes(self, notes) -> None:
        self._grad_notes = notes
        if notes is not None and self._last is not None:
            self._notes_handles += notes.hook(self._last.params)

    def _keep_last_staging(self) -> LastBucketSlots:
        group, bucket = self.order[0]
        layout = group.layout.buckets[bucket]
        buffer = self.pool.acquire(layout.range.size, group.dtype)
        indices = list(layout.param_indices)
        start = layout.range.start  # the slots' and this rank's slice's offsets within the staging
        slots = list(_bucket_slots(group, bucket, buffer).values())
        # reduced in place, this rank's slice of the staging is the bucket's gradient shard; lent first, as what
        # the shard holds goes along, then the slots take the parameters' waiting gradients (LastBucketSlots)
        group.lend_grad_shard(bucket, buffer[layout.shard_range(self.rank).shift(-start).as_slice()])
        last = LastBucketSlots(indices, [group.params[i] for i in indices], slots, buffer)
        weakref.finalize(self, last.arrivals.clear)  # the list may hold parameters: not past the reducer
        return last

    # -- stage 2: during backward --------------------------------------------------------------------------
    def _reset_backward_state(self) -> None:
        self._states = [_BucketState() for _ in self.order]
        self._next = len(self.order) - 1
        self._expected: list[int] = []  # per position: parameters taking part, counted when a backward starts
        self.session.close()
        self.session.unsynced_grads = False

    def _count_expected(self) -> None:
        self._expected = [_requires_grad(params).count(True) for params in self._bucket_params]

    def joined_backward(self) -> None:
        """A joined rank's backward (``engine.join()``): stage 2 reduces every bucket, last first, as the ranks
        with data do: the same buckets, holding zeros. Stage 1 reduces at the step, which the joined rank runs."""
        if not self.partition_grads:
            return
        self._count_expected()
        self.finish_backward()

    def _register_hooks(self) -> None:
        self._handles = []
        reducer = weakref.ref(self)  # the hooks hold the reducer weakly (weak_hooks.py says why)
        for position, (group, bucket) in enumerate(self.order):
            if position == 0:
                continue  # the bucket reduced last: builtin hooks (last_bucket.py)
            for index in group.layout.buckets[bucket].param_indices:
                param = group.params[index]
                if param.requires_grad:  # a frozen one is hooked when it becomes trainable (a new reducer)
                    hook = functools.partial(_grad_ready, reducer, position, index)
                    self._handles.append(param.register_post_accumulate_grad_hook(hook))
        if self._last is not None:
            self._handles += self._last.hook()

    def holds_unsynced(self) -> bool:
        """Whether a parameter outside the last bucket holds a local gradient in ``.grad`` (the last bucket's
        wait in its slots for the step's reduction anyway)."""
        return _grads_of(self._hooked_params).count(None) < len(self._hooked_params)

    def before_forward(self) -> None:
        """The last bucket's ``.grad`` are their slots again (LastBucketSlots.settle), unless its staging holds a
        reduced gradient, not to be touched until the step consumes it."""
        if self._last is not None and not self.order[0][0].holds_reduced(self.order[0][1]):
            self._last.settle()

    def zero_last_bucket(self, parts: list[FlatParamGroup]) -> None:
        """zero_grad: the last bucket's slots (its gradient shard among them) are zeroed, if its group is in
        ``parts``."""
        if self._last is not None and self.order[0][0] in parts:
            self._last.clear()

    def close(self) -> None:
        """Remove the hooks: a new reducer (over more groups) replaces this one. The last bucket's parameters get
        a ``.grad`` of their own (what waits in their slots, or None), and its staging goes back to the pool."""
        for handle in getattr(self, "_handles", []) + self._notes_handles:
            handle.remove()
        self._handles, self._notes_handles = [], []
        if self._last is not None:
            self._last.hand_back()
            group, bucket = self.order[0]
            group.lend_grad_shard(bucket, None)
            self.pool.release(self._last.buffer)
            self._last = None

    def _stage(self, position: int, index: int, grad: torch.Tensor) -> None:
        state = self._states[position]
        (state.views or self._open_staging(position, state))[index].copy_(grad)

    def _open_staging(self, position: int, state: _BucketState) -> dict:
        """Acquire the bucket's (zeroed) staging buffer; returns each parameter's slot in it, shaped like the
        parameter. The views are made once per (bucket, pool buffer), not per parameter per step. Every trainable
        parameter of the bucket without a gradient yet gets its slot as ``.grad``, so that autograd accumulates
        its gradient there in place (as into stage 1's flat gradients) and the hook copies nothing; the bucket's
        launch takes the slots back (_release_slots)."""
        group, bucket = self.order[position]
        if state.staging is None:
            state.staging = self.pool.acquire(group.layout.buckets[bucket].range.size, group.dtype)
        key = (position, state.staging.data_ptr())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = _bucket_slots(group, bucket, state.staging)
        state.views = views
        params, foreign = group.params, 0
        for index, view in views.items():
            param = params[index]
            grad = param.grad
            if grad is None:
                if param.requires_grad:
                    param.grad = view
            elif grad is not view:
                foreign += 1  # the gradient that opened the staging, or one left from no_sync
        state.foreign = foreign
        return views

    def _release_slots(self, position: int, state: _BucketState) -> None:
        """Before a bucket is reduced (in place, over its staging buffer): no parameter keeps its slot as .grad."""
        params = self.order[position][0].params
        for index, view in state.views.items():
            if params[index].grad is view:
                params[index].grad = None

    def _is_complete(self, position: int) -> bool:
        return len(self._states[position].seen) >= self._expected[position]

    def _launch_ready(self) -> None:
        while self._next >= 0 and self._is_complete(self._next):
            if self._expected[self._next]:
                self._launch_staged(self._next)
            self._next -= 1

    def _launch_staged(self, position: int) -> None:
        group, bucket = self.order[position]
        state = self._states[position]
        size = group.layout.buckets[bucket].range.size
        if state.staging is None:
            state.staging = self.pool.acquire(size, group.dtype)  # nothing arrived here on this rank
        else:
            self._release_slots(position, state)
        job = self._reduce(group, bucket, state.staging[:size], accumulate=True)
        job.whole = len(state.seen) == len(group.layout.buckets[bucket].param_indices)
        job.scratch.append(state.staging)
        state.staging = state.views = None
        self._inflight.push(job)

    def finish_backward(self, only: Optional[set] = None) -> None:
        """End of a backward: stage what no hook delivered, launch the remaining buckets in order, wait.

        ``only``: flush just these groups' buckets (one optimizer's step), whatever their requires_grad; the
        others keep their local gradients in ``param.grad``. Without it, buckets frozen for this backward wait.
        """
        unused = []
        for position in range(self._next, -1, -1):
            if (only is not None and self.order[position][0] not in only) or \
                    (only is None and not self._expected[position]):
                continue
            if position == 0 and self._last is not None:
                continue  # reduced when the step needs it (reduce_last)
            unused += self._stage_leftovers(position)
            self._launch_staged(position)
        self._inflight.drain()
        self._reset_backward_state()
        # any parameter still holding a gradient (frozen for this backward, or another optimizer's)
        self.session.unsynced_grads = self.holds_unsynced()
        if unused and not self.ignore_unused:
            raise RuntimeError(unused_parameters_message(unused))

    def reduce_last(self, only: set) -> None:
        """Stage 2: reduce the bucket reduced last (last_bucket.py) in place in its kept staging, whose slice is
        this rank's gradient shard of it, if its group is in ``only``. Its parameters' gradients of every backward
        since the last reduction are in their slots; the reduced ones stay there until zero_grad."""
        last = self._last
        if last is None or self.order[0][0] not in only:
            return
        group, bucket = self.order[0]
        if group.holds_reduced(bucket):
            return  # reduced already since zero_grad (a second reduction would add the average to itself)
        last.settle()
        arrived = last.take_arrivals()
        staging = last.buffer[: group.layout.buckets[bucket].range.size]
        self._inflight.push(self._reduce(group, bucket, staging, accumulate=False))
        self._inflight.drain()
        if not self.ignore_unused and len(arrived) < len(last.indices):
            unused = [group.names[i] for i, p in zip(last.indices, last.params) if p.requires_grad and i not in arrived]
            if unused:
                raise RuntimeError(unused_parameters_message(unused))

    def _stage_leftovers(self, position: int) -> list[str]:
        """Gradients still held by parameters (accumulated under no_sync); names of parameters with none."""
        group, bucket = self.order[position]
        state, unused = self._states[position], []
        if len(state.seen) == len(group.layout.buckets[bucket].param_indices):
            return unused  # every parameter's gradient arrived through its hook
        for index in group.layout.buckets[bucket].param_indices:
            param = group.params[index]
            if index in state.seen:
                continue
            if param.grad is None or (state.views is not None and param.grad is state.views[index]):
                if param.requires_grad:
                    unused.append(group.names[index])
                continue
            self._stage(position, index, param.grad)
            param.grad = None
            state.seen.add(index)
        return unused

    def flush_unsynced(self, only: set) -> None:
        """Stage 2: reduce gradients of the groups ``only`` left in ``param.grad`` by backward passes run
        entirely under no_sync (or while those parameters were frozen); the last bucket is reduce_last's."""
        if self.partition_grads and self.session.unsynced_grads:
            self.finish_backward(only)

    def quiesce(self, communicate: bool) -> None:
        """Teardown: wait for every bucket in flight (or forget them when the process group is gone)."""
        if communicate:
            self._inflight.drain()
        else:
            self._inflight.drop()

    # -- stage 1: once per step ----------------------------------------------------------------------------
    def reduce_full_grads(self, only: set) -> None:
        """Stage 1: reduce every bucket of the groups ``only`` from the full gradient buffers, last first."""
        for group, bucket in reversed(self.order):
            if group not in only:
                continue
            source = group.bucket_grad_input(group.layout.buckets[bucket])
            # in place: this rank's slice of the bucket is its gradient shard (torch's in-place convention)
            self._inflight.push(self._reduce(group, bucket, source, accumulate=False))
        self._inflight.drain()

    # -- the collectives -----------------------------------------------------------------------------------
    def _reduce(self, group: FlatParamGroup, bucket: int, source: torch.Tensor, accumulate: bool) -> _InFlight:
        """Average ``source`` (one bucket) over ranks; this rank's slice goes to its gradient shard. ``source`` may
        be overwritten (stage 1's flat gradients, whose slice is the gradient shard itself; stage 2's staging
        buffer), so it is reduced in place (Communicator.reduce_scatter_in_place), with no scratch."""
        shard_size = group.layout.buckets[bucket].shard_size
        if not self.use_reduce_scatter:
            source.div_(self.world_size)  # every rank keeps the whole average (stage 1 leaves DDP's param.grad)
            work = self.comm.all_reduce(source, async_op=self.overlap, over="gradients")
            own = source[self.rank * shard_size : (self.rank + 1) * shard_size]
            return _InFlight(group, bucket, work, own, [], accumulate, 1.0)
        # fp16 (and qgZ's blocks) pre-divide as DDP does, so the sum stays in range; otherwise the 1/N rides on
        # the copy or add into the gradient shard (_complete), over 1/N of the elements and with no extra pass.
        post = 1.0 / self.world_size
        if source.dtype == torch.float16 or self.comm.options.quantize_gradients:
            source.div_(self.world_size)
            post = 1.0
        if not self.comm.options.quantize_gradients:  # qgZ's all-to-all needs its own output
            # this rank's slice of the bucket is its result (stage 1: its gradient shard itself)
            work = self.comm.reduce_scatter_in_place(source, async_op=self.overlap)
            own = source[self.rank * shard_size : (self.rank + 1) * shard_size]
            return _InFlight(group, bucket, work, own, [], accumulate, post)
        scratch = self.pool.acquire(shard_size, group.dtype, zeroed=False)  # the collective writes all of it
        work = self.comm.reduce_scatter(scratch[:shard_size], source, async_op=self.overlap)
        return _InFlight(group, bucket, work, scratch[:shard_size], [scratch], accumulate, post)

    def _complete(self, job: _InFlight) -> None:
        """Wait for one collective (the reduction queue's oldest) and add its result to the gradient shard."""
        if job.work is not None:
            job.work.wait()
        target, overwrite = job.group.take_grad_shard(job.bucket)
        if job.accumulate and not overwrite:
            target.add_(job.result, alpha=job.scale)
        elif job.accumulate and job.scale == 1.0:
            target.copy_(job.result)  # the step's first reduction: the shard held nothing (not even zeros)
        elif target.data_ptr() != job.result.data_ptr():
            torch.mul(job.result, job.scale, out=target)
        elif job.scale != 1.0:
            target.mul_(job.scale)
        if job.group.on_grad_reduced is not None:
            job.group.reduced_whole = job.whole
            job.group.on_grad_reduced(job.group, job.bucket)
        for buffer in job.scratch:
            self.pool.release(buffer)


def _bucket_slots(group: FlatParamGroup, bucket: int, staging: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each parameter of ``bucket`` (by index in its group) -> its slot in ``staging``, shaped like it."""
    start = group.layout.buckets[bucket].range.start
    return {i: staging[group.layout.slots[i].range.shift(-start).as_slice()].view_as(group.params[i])
            for i in group.layout.buckets[bucket].param_indices}


def _grads_of(params: list) -> list:
    return list(map(_GRAD, params))  # map with a getter: no Python frame per parameter


def _requires_grad(params: list) -> list:
    return list(map(_REQUIRES_GRAD, params))


_GRAD, _REQUIRES_GRAD = operator.attrgetter("grad"), operator.attrgetter("requires_grad")


def _grad_ready(reducer_ref: weakref.ref, position: int, index: int, param: torch.Tensor) -> None:
    """Stage 2's hook on each parameter: stage its gradient in its bucket, and launch the buckets it completes.
    A module function holding the reducer weakly, so that a gradient costs one Python call (this one): it runs
    288 times per step on the CPU proxy (docs/benchmarks.md)."""
    self = reducer_ref()
    if self is None:
        return
    notes = self._grad_notes
    if notes is not None:
        notes.record(param)  # the engine's note (grad_notes.py): a builtin call unless armed
    session = self.session
    if not (session.open and session.sync) and not session.grad_arrived():
        return  # no_sync: autograd keeps accumulating in param.grad
    if position > self._next:
        group = self.order[position][0]
        raise RuntimeError(
            f"parameter '{group.names[index]}' produced a second gradient in one backward after its bucket "
            "was reduced; with torch.utils.checkpoint pass use_reentrant=False"
        )
    state = self._states[position]
    seen = state.seen
    view = (state.views or self._open_staging(position, state))[index]
    grad = param.grad
    if grad is not view:  # not accumulated in its slot by autograd (see GradReducer._open_staging)
        view.add_(grad) if index in seen else view.copy_(grad)
        param.grad = view  # a second gradient in this backward accumulates there in place
    seen.add(index)
    if len(seen) >= self._expected[position]:  # only a completed bucket can let the launches move on
        self._launch_ready()
