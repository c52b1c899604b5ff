"""The exact overlap of the offloaded step with the next forward (issue 38): the maths of the step unchanged.

Once the step's agreements are made (overflow, which parameters got a gradient, the clip coefficient: each needs
every gradient), the step call hands the host step to a thread and returns. The thread steps the parts (stage 3
units, or stages 1-2 flat groups) one at a time in the order the next forward needs them
(``runtime.update_order``), each part's Adam/AdamW chunks with torch's fused CPU kernel exactly as the chunked
step does (chunked_step.py: cuts aligned inside a piece, so bit for bit the whole-piece step; with ``nvme``, tile
by tile, each read in and written out as the inline step does), then writes that part's updated masters into the
model's parameter shards and marks the part ready. Whatever reads a part's shard first waits for it
(:func:`zero_core.contracts.wait_for_update`): stage 3's gather of a unit (the next
forward waits per unit, not for the whole step), and stages 1-2's all-gather of a group after the step (group g
is gathered while the thread steps group g+1). On an accelerator the wait is a stream wait on the write-back's
copies, not a host wait.

Everything else that reads or changes the masters, their optimizer state or the host gradient buffers waits for
the whole step first (``OptimizerOffload.settle``): the next step, the next backward's gradient copies,
checkpoints, full state dicts, the debugging API, the moving average of the weights, ``engine.close()``.

What stays on the training thread, at the step call: the step counters (``state["step"]``), the optimizer's
hooks and the counters LR schedulers patch in (one step over no parameters), and the kernels' hyperparameters,
read there, so an LR scheduler stepped right after ``step()`` applies from the next step, as without overlap.
Gradients not already in host buffers of the offload's own (copied during backward) are copied into them at the
step call, since the engine zeroes the gradient shards when the call returns.

With ``offload_optimizer.overlap_with_backward`` (stages 2-3, ``device: cpu``) a unit's step (stage 2: a reduce
bucket's pieces') starts earlier still: once backward has reduced it and its gradients' copy to the host has landed
(``start_early``), while backward goes on; the step call then hands over what backward left, which the thread
takes in the next forward's order (step_queue.py). A stage 2 group's reader waits for all of its buckets
(``PartUpdates``). Only where that is exact: every parameter of the unit got a gradient here, nothing needs every
gradient first (no clipping, no fp16: refused at setup, or the early start turns off at the first step that
clips), and a step follows every backward that reduces (a second one, or zero_grad without a step, raises).

Used where the step is torch's fused Adam/AdamW and every stepped piece already has state (from the second
step on), with ``device: cpu`` or ``nvme`` (its gradients then wait in host memory for the thread) and
parameter shards not swapped to NVMe; elsewhere the step runs as before, inline. On by default with ``device:
cpu`` (``offload_optimizer.overlap_with_forward``: null), and then only where the shards are on an accelerator;
on a CPU-only run the thread would compete with the forward for the same cores, so it is off there unless forced
(tests). docs/offload.md, "The step overlapped with the next forward" and "The step started during backward".
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Optional

import torch

from zero_core.optim.kernels import only_params
from zero_core.optim.master_shards import TileEntry, master_tiles, tile_runs, unscale_and_clip
from zero_core.offload import chunked_step
from zero_core.offload.chunked_step import ChunkPlan, grad_factor, piece_kernels, steps_fused_adam
from zero_core.offload.host_masters import write_back_pieces
from zero_core.offload.nvme_swap import split_into_tiles
from zero_core.offload.placement import _copy_stream, copy_between
from zero_core.offload.step_queue import StepQueue, Work
from zero_core.offload.step_thread import host_step_pool

_WHOLE = 1 << 62  # master_tiles: one tile of everything (the parts are split below)
_FAILED = ("offload_optimizer: the overlapped host step failed on its thread (the parameters it did not reach "
           "keep their values from before the step); set "
           "zero_optimization.offload_optimizer.overlap_with_forward: false to run the step inline, and report the "
           "error below")


class PartTiming(NamedTuple):
    """One part's turn on the thread (``time.perf_counter`` seconds), for benchmarks (benchmarks/gpu_offload.py)."""

    taken: float  # the thread took it
    arrived: float  # its gradients were in host memory (== taken when no copy was in flight)
    stepped: float  # its kernels returned
    written: float  # its write-back was issued
    numel: int  # elements stepped
    early: bool  # handed over during backward (overlap_with_backward)


class UpdateInFlight:
    """One part's update on the thread: ``wait()`` returns once its values are in the part's parameter shards
    (on an accelerator: once the calling stream is ordered after the write-back's copies)."""

    issued = False  # the thread makes it

    def __init__(self, step: "OverlappedStep") -> None:
        self._step = step
        self._done = threading.Event()
        self._copied: Optional[tuple[torch.device, "torch.cuda.Event"]] = None

    def finish(self, copied: Optional[tuple[torch.device, "torch.cuda.Event"]]) -> None:
        self._copied = copied
        self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self._step.waited_seconds += time.perf_counter() - start
        self._step.raise_error()
        if self._copied is not None:
            device, event = self._copied
            torch.cuda.current_stream(device).wait_event(event)


class PartUpdates:
    """The updates of one stages 1-2 group whose buckets backward started one by one (``start_early`` with a
    bucket), and of the rest of it the step call handed over: its reader (the all-gather after the step) waits
    for every one."""

    issued = False  # the thread makes them

    def __init__(self, queue: StepQueue) -> None:
        self.queue = queue  # the step they belong to
        self.handles: list[UpdateInFlight] = []

    def ready(self) -> bool:
        return all(handle.ready() for handle in self.handles)

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()


def _entries_of(parts: list, used: list[list[bool]]) -> list[TileEntry]:
    return [entry for tile in master_tiles(parts, used, _WHOLE) for entry in tile]


def _bucket_of(entry: TileEntry) -> int:
    """The bucket of the part's shards that holds ``entry``'s piece."""
    return entry.part.master_shards.pieces[entry.index].bucket


def _group_kernels(kernels: dict) -> list:
    """The distinct kernels of ``piece_kernels``' result (one per group, in group order)."""
    return list({id(kernel): kernel for kernel in kernels.values()}.values())


def _same_hyperparameters(a: dict, b: dict) -> bool:
    """Whether two ``piece_kernels`` results of one optimizer hold the same hyperparameters."""
    def plain(kernel) -> dict:
        return {k: (float(v) if torch.is_tensor(v) else v) for k, v in kernel.kwargs.items()}
    ours, theirs = _group_kernels(a), _group_kernels(b)
    return len(ours) == len(theirs) and all(plain(x) == plain(y) for x, y in zip(ours, theirs))


class OverlappedStep:
    """The overlapped host steps of one ``OptimizerOffload`` (``owner``), on one thread."""

    def __init__(self, owner, with_backward: bool = False) -> None:
        self.owner = owner
        # offload_optimizer.overlap_with_backward: a part's step may start once backward has reduced it
        self.with_backward = with_backward
        self.overlapped_steps = 0  # a counter: steps handed to the thread
        self.parts_stepped_in_backward = 0  # a counter: parts whose step started before the step call
        # For benchmarks (benchmarks/gpu_offload.py): the last step's time on the thread stepping and writing back
        # (not waiting for backward), and the training thread's host waits for parts since the last step call
        self.thread_seconds = 0.0
        self.waited_seconds = 0.0
        self.timeline: list[PartTiming] = []  # the last finished step's parts, in the order the thread took them
        self.step_called_at = 0.0  # perf_counter at the last step call that handed its step over
        self._pool: Optional[ThreadPoolExecutor] = None
        self._flight: Optional[Future] = None
        self._queue: Optional[StepQueue] = None
        self._parts: list = []  # parts with an update in flight
        self._error: Optional[BaseException] = None
        self._last: Optional[tuple] = None  # (optimizer, ids of its parts) of the last step that could overlap
        self._warned_hyperparameters = False
        # (id(part), bucket or None) of the coming step call's step that a settle finished
        self._stepped_early: set[tuple[int, Optional[int]]] = set()

    # -- the step call (training thread) -------------------------------------------------------------------
    def applies(self, optimizer: torch.optim.Optimizer, parts: list, forced: Optional[bool]) -> bool:
        """Whether this step can be overlapped (``forced``: True/False, or None for where it helps)."""
        if forced is False or not parts:
            return False
        if any(part.swap is not None for part in parts):
            return False  # parameter shards on NVMe: written back by the part itself, after the step
        if forced is None and not self.owner._on_accelerator(parts):
            return False
        return steps_fused_adam(optimizer)

    def remember(self, optimizer: torch.optim.Optimizer, parts: list, inv_scale: float,
                 clip: Optional[torch.Tensor]) -> None:
        """A step that could overlap: the next backward may start these parts' steps early, unless this step
        clipped or unscaled (that needs every gradient first: then the early start is off for the run), or
        another optimizer steps too (each would need its own order)."""
        if not self.with_backward:
            return
        if clip is not None or inv_scale != 1.0:
            self.with_backward = False
            warnings.warn("offload_optimizer.overlap_with_backward is off for the rest of this run: the step "
                          "clipped gradients or unscaled them (fp16), which needs every gradient before any part "
                          "steps; stop clipping, or set overlap_with_backward: false", stacklevel=4)
            return
        if self._last is not None and self._last[0] is not optimizer:
            self.with_backward = False  # several optimizers: each step is started at its own call
            return
        self._last = (optimizer, {id(part) for part in parts})

    def start_early(self, part, bucket: Optional[int] = None) -> None:
        """Backward reduced ``part`` (a stage-3 unit: ``bucket`` None) or one bucket of it (stage 2), and its
        gradients are on their way to the host: hand its step to the thread now, when the step it belongs to is
        known to be exact this early. Every parameter of what was reduced got a gradient here (so it is stepped
        whatever the others say), it has Adam state, and it is no persistent unit (those are gathered at once after
        the step)."""
        if not self.with_backward or self._last is None:
            return
        optimizer, ids = self._last
        if id(part) not in ids or part.swap is not None or getattr(part, "persistent", False) \
                or not part.reduced_whole:
            return
        key = (id(part), bucket)
        queue = self._open_queue()
        if key in self._stepped_early or (queue is not None and key in queue.early):
            self.with_backward = False  # the engine stays usable (the reductions still in flight come here too)
            self.settle()
            raise RuntimeError(
                f"offload_optimizer.overlap_with_backward: a second backward reduced a part whose step had "
                f"already started ({', '.join(part.names[:3])}); it needs step() after every backward that "
                "reduces (accumulate with no_sync, as the front-ends do), or set overlap_with_backward: false")
        entries = _entries_of([part], [[True] * len(part.params)])
        if bucket is not None:  # the pieces of that bucket
            entries = [entry for entry in entries if _bucket_of(entry) == bucket]
        states = [optimizer.state.get(entry.piece) for entry in entries]
        if not entries or any(not state or "exp_avg" not in state for state in states):
            return
        if queue is None:
            self.settle()
            queue = self._open(piece_kernels(optimizer, self.owner.compiled))
        grads = self.owner.grads.owned(entries, consume=False)
        arrived = None
        shard = part.grad_view(bucket or 0)
        if shard.is_cuda:
            arrived = torch.cuda.Event()
            arrived.record(_copy_stream(shard.device, to_device=False))
        torch._foreach_add_([state["step"] for state in states], 1)
        handle = UpdateInFlight(self)
        self._hand_over(part, handle, queue, split=bucket is not None)
        part.master_shards.written_back = True
        queue.early.append(key)
        self.parts_stepped_in_backward += 1
        queue.put(Work(part, entries, states, grads, handle, arrived, 1.0, None, bucket))

    def _hand_over(self, part, handle: UpdateInFlight, queue: StepQueue, split: bool) -> None:
        """``part``'s reader waits for ``handle``: alone, or with the handles of the buckets backward started."""
        current = part.update_in_flight
        if isinstance(current, PartUpdates) and current.queue is queue:
            current.handles.append(handle)
        elif split:
            part.update_in_flight = PartUpdates(queue)
            part.update_in_flight.handles.append(handle)
        else:
            part.update_in_flight = handle
        if not any(known is part for known in self._parts):
            self._parts.append(part)

    def start(self, optimizer: torch.optim.Optimizer, parts: list, used: list[list[bool]], inv_scale: float,
              clip: Optional[torch.Tensor]) -> bool:
        """Hand the step to the thread (``parts`` in the order the next forward needs them) and return True; or
        False, having done nothing, when a stepped piece has no state yet (its first step runs inline). Parts
        backward already handed over (``start_early``) are not stepped again."""
        queue = self._open_queue()
        if queue is None:
            self.settle()
        # parts (or buckets) backward handed over: in flight, or stepped already (something waited for them
        # before this call)
        early = set(queue.early) if queue is not None else set()
        early |= self._stepped_early
        self._stepped_early = set()
        entries = [entry for entry in _entries_of(parts, used)
                   if (id(entry.part), None) not in early and (id(entry.part), _bucket_of(entry)) not in early]
        stepped = {id(entry.part) for entry in entries}
        started = {key[0] for key in early}
        # a part with pieces left to step, or none of it started (it may have nothing to step: its work is empty)
        rest = [part for part in parts if id(part) in stepped or id(part) not in started]
        states = [optimizer.state.get(entry.piece) for entry in entries]
        problem = None
        if any(not state or "exp_avg" not in state for state in states):
            problem = "new"
        elif queue is not None and (clip is not None or inv_scale != 1.0):
            problem = "clip"
        if problem is not None:
            if queue is None:
                return False
            queue.close([], {})
            self.settle()
            if problem == "new":
                raise RuntimeError(
                    "offload_optimizer.overlap_with_backward: parameters without optimizer state yet (unfrozen or "
                    "first used since the last step) joined a step that backward had already started; set "
                    "overlap_with_backward: false while the trainable set changes")
            raise RuntimeError(
                "offload_optimizer.overlap_with_backward started parts' steps during backward, but this step "
                "clips (or unscales) the gradients, which needs every gradient first: the parts stepped early were "
                "not clipped. Stop clipping (gradient_clipping: 0, no clip_grad_norm_) or set "
                "overlap_with_backward: false")
        kernels = piece_kernels(optimizer, self.owner.compiled)  # hyperparameters as of now
        if queue is not None:
            if not _same_hyperparameters(kernels, queue.kernels) and not self._warned_hyperparameters:
                self._warned_hyperparameters = True
                warnings.warn("offload_optimizer.overlap_with_backward: the optimizer's hyperparameters changed "
                              "between backward and step(); this step uses those of backward's time for every "
                              "part (the new ones apply from the next step)", stacklevel=4)
            kernels = queue.kernels
        grads = self.owner.grads.owned(entries)  # in host memory, the offload's own buffers
        if states:  # (backward may have started every part)
            torch._foreach_add_([state["step"] for state in states], 1)  # once per piece, as Adam's step does
        with only_params(optimizer, []):  # its hooks and patched counters (LR schedulers), once, here
            optimizer.step()
        by_part: dict[int, list[int]] = {}
        for position, entry in enumerate(entries):
            by_part.setdefault(id(entry.part), []).append(position)
        works = []
        if queue is None:
            queue = self._open(kernels)
        for part in rest:
            handle = UpdateInFlight(self)
            self._hand_over(part, handle, queue, split=False)
            part.master_shards.written_back = True  # the thread writes every stepped piece back itself
            positions = by_part.get(id(part), [])
            works.append(Work(part, [entries[i] for i in positions], [states[i] for i in positions],
                               [grads[i] for i in positions], handle, None, inv_scale, clip))
        queue.close(works, {id(part): index for index, part in enumerate(parts)})
        self.step_called_at = time.perf_counter()
        self.waited_seconds = 0.0  # (the next backward may open the next step's queue before they are read)
        self.overlapped_steps += 1
        return True

    def _open(self, kernels: dict) -> StepQueue:
        """A new step's queue, and the thread that works through it."""
        self._error = None
        self._parts = []
        if self._pool is None:
            self._pool = host_step_pool("zero-offload-overlapped-step")
        self._queue = StepQueue(kernels)
        self._flight = self._pool.submit(self._run, self._queue)
        return self._queue

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self, queue: StepQueue) -> None:
        shards: list[torch.Tensor] = []
        busy = 0.0
        timeline: list[PartTiming] = []
        work = None
        try:
            while (work := queue.take()) is not None:
                start = time.perf_counter()
                if work.arrived is not None:
                    work.arrived.synchronize()  # its gradients' copy to the host, issued during backward
                arrived = time.perf_counter()
                if self.owner.swapper is not None:  # nvme: tile by tile, each read in, stepped, written back, out
                    self._step_swapped(work, queue)
                    stepped = time.perf_counter()
                    work.handle.finish(None)
                else:
                    if work.entries:
                        self._step_part(work.entries, work.states, work.grads, queue.kernels, work.inv_scale,
                                        work.clip)
                    stepped = time.perf_counter()
                    work.handle.finish(self._write_back(work.entries, shards))
                written = time.perf_counter()
                busy += written - start
                numel = sum(entry.grad.numel() for entry in work.entries)  # (a swapped-out master is empty)
                early = (id(work.part), work.bucket) in queue.early
                timeline.append(PartTiming(start, arrived, stepped, written, numel, early))
                work = None
            self.thread_seconds = busy
            self.timeline = timeline
            for device in {shard.device for shard in shards if shard.is_cuda}:  # before the next step changes the
                _copy_stream(device, to_device=True).synchronize()  # masters they read (not the compute stream)
        except BaseException as error:  # every waiter raises it (raise_error)
            self._error = error
            if work is not None:
                work.handle.finish(None)
            queue.fail()
            raise

    def _step_swapped(self, work: Work, queue: StepQueue) -> None:
        """One part's pieces with ``device: nvme``, in tiles of at most ``sub_group_size`` elements as the inline
        step takes them: the next tile is read while this one steps, and this one's write overlaps the next."""
        owner, swap = self.owner, self.owner.swapper
        entries, states, grads = work.entries, work.states, work.grads
        kernels, inv_scale, clip = queue.kernels, work.inv_scale, work.clip
        positions = list(range(len(entries)))
        # swapped out between steps, a piece's tensor is empty: its size is the file's
        in_file = owner.swapped.numel_in_file
        tiles = split_into_tiles(positions, lambda i: in_file(entries[i].piece), owner.sub_group_size)
        masters = lambda tile: [entries[i].piece for i in tile]  # noqa: E731
        reading = swap.swap_in(owner.swapped.items(masters(tiles[0]))) if tiles else None
        writing = None
        try:
            for index, tile in enumerate(tiles):
                reading.wait()
                reading = None
                if index + 1 < len(tiles):
                    reading = swap.read_next(owner.swapped.items(masters(tiles[index + 1])))
                self._step_part([entries[i] for i in tile], [states[i] for i in tile], [grads[i] for i in tile],
                                kernels, inv_scale, clip)
                write_back_pieces([entries[i] for i in tile])
                writing = swap.write_after(writing, owner.swapped.items(masters(tile)))
        finally:
            if reading is not None:
                reading.wait()
            if writing is not None:
                writing.wait()

    def _step_part(self, entries: list[TileEntry], states: list, grads: list[torch.Tensor], kernels: dict,
                   inv_scale: float, clip: Optional[torch.Tensor]) -> None:
        """One part's pieces in chunks of at most ``chunk_numel`` (no copies around them here: the part is written
        back whole, after its last chunk), each unscaled and clipped just before its kernel."""
        compiled = self.owner.compiled  # the compiled kernel scales the 16-bit gradients as it reads them
        plan = ChunkPlan([entry.piece for entry in entries], states, grads, kernels,
                         grad_factor(inv_scale, clip) if compiled else 1.0)
        scaled = not compiled and (inv_scale != 1.0 or clip is not None)
        chunks = plan.cuts(self.owner.chunk_numel)
        with torch.no_grad():
            for lo, hi in chunks:
                if scaled:
                    unscale_and_clip(plan.grads(lo, hi), inv_scale, clip)
                chunked_step._step_chunk(plan, lo, hi)
        self.owner.chunks_stepped += len(chunks)

    @staticmethod
    def _write_back(entries: list[TileEntry], shards: list) -> Optional[tuple]:
        """The part's stepped pieces into its parameter shards (one copy per contiguous run); on an accelerator,
        an event after those copies on the copy stream (placement.py)."""
        device = None
        with torch.no_grad():
            for part, bucket, start, end, _ in tile_runs(entries):
                master = part.master_shards.buckets[bucket][start:end]
                shard = part.param_shards()[bucket][start:end]
                if shard.data_ptr() != master.data_ptr():
                    copy_between(shard, master)
                    shards.append(shard)
                    if shard.is_cuda:
                        device = shard.device
        if device is None:
            return None
        event = torch.cuda.Event()
        event.record(_copy_stream(device, to_device=True))
        return device, event

    # -- waiting ---------------------------------------------------------------------------------------------
    def raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(_FAILED) from self._error

    def settle(self) -> None:
        """Wait for the step in flight: the masters, their state and the model's shards are those after it. Of a
        step that backward started and no step call finished yet, the parts handed over are stepped; the step
        call that follows steps only the rest (``_stepped_early``)."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        queue, self._queue = self._queue, None
        if queue is not None and not queue.closed:
            self._stepped_early = set(queue.early)
            queue.close([], {})
        for part in self._parts:
            part.update_in_flight = None
        self._parts = []
        try:
            flight.result()
        except BaseException:
            pass  # reported below, with what to do
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(_FAILED) from error

    def _open_queue(self) -> Optional[StepQueue]:
        """The queue of a step backward started and no step call closed yet, if any."""
        return self._queue if self._queue is not None and not self._queue.closed else None

    def settle_previous(self) -> None:
        """Wait for the last step's update, not for one backward is starting now (``start_early``)."""
        if self._open_queue() is None:
            self.settle()

    def started_in_backward(self) -> int:
        """Parts of a step that backward started and no step call has finished yet."""
        queue = self._open_queue()
        return len(queue.early) if queue is not None else len(self._stepped_early)

    def discard_early(self) -> None:
        """The gradients were zeroed without a step: the parts backward stepped stay stepped (zero_grad's error
        says so), and no step call is owed for them."""
        self.settle()
        self._stepped_early = set()

    def stop(self) -> None:
        try:
            self.settle()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
