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

Used where the step is torch's fused Adam/AdamW and every stepped piece already has state (from the second
step on), with ``device: cpu`` or ``nvme`` (its gradients then wait in host memory for the thread) and
parameter shards not swapped to NVMe; elsewhere the step runs as before, inline. Opt-in
(``offload_optimizer.overlap_with_forward: true``), and then only where the shards are on an accelerator; on a
CPU-only run the thread would compete with the forward for the same cores, so it is off there unless forced
(tests). On one H200 it measured no faster than the inline step at 1.75B and slower at 6.58B.
docs/offload.md, "The step overlapped with the next forward".
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from zero_core.optim.kernels import only_params
from zero_core.optim.master_shards import TileEntry, master_tiles, tile_runs, unscale_and_clip
from zero_core.offload import chunked_step
from zero_core.offload.chunked_step import ChunkPlan, piece_kernels, steps_fused_adam
from zero_core.offload.host_masters import write_back_pieces
from zero_core.offload.nvme_swap import split_into_tiles
from zero_core.offload.placement import _copy_stream, copy_between

_WHOLE = 1 << 62  # master_tiles: one tile of everything (the parts are split below)
_FAILED = ("offload_optimizer: the overlapped host step failed on its thread (the parameters it did not reach "
           "keep their values from before the step); set "
           "zero_optimization.offload_optimizer.overlap_with_forward: false to run the step inline, and report the "
           "error below")


def _use_threads(count: int) -> None:
    """This thread's torch CPU kernels use ``count`` threads (torch reads the count once per thread, first)."""
    torch.get_num_threads()
    torch.set_num_threads(count)


class UpdateInFlight:
    """One part's update on the thread: ``wait()`` returns once its values are in the part's parameter shards
    (on an accelerator: once the calling stream is ordered after the write-back's copies)."""

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


class OverlappedStep:
    """The overlapped host steps of one ``OptimizerOffload`` (``owner``), on one thread."""

    def __init__(self, owner) -> None:
        self.owner = owner
        self.overlapped_steps = 0  # a counter: steps handed to the thread
        # For benchmarks (benchmarks/gpu_offload.py): the last thread's wall time from its start to its last part's
        # write-back issued, and the training thread's host waits for parts, summed since the last step call
        self.thread_seconds = 0.0
        self.waited_seconds = 0.0
        self._pool: Optional[ThreadPoolExecutor] = None
        self._flight: Optional[Future] = None
        self._parts: list = []  # parts with an update in flight
        self._error: Optional[BaseException] = None

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

    def start(self, optimizer: torch.optim.Optimizer, parts: list, used: list[list[bool]], inv_scale: float,
              clip: Optional[torch.Tensor]) -> bool:
        """Hand the step to the thread (``parts`` in the order the next forward needs them) and return True; or
        False, having done nothing, when a stepped piece has no state yet (its first step runs inline)."""
        self.settle()
        entries = [entry for tile in master_tiles(parts, used, _WHOLE) for entry in tile]
        states = []
        for entry in entries:
            state = optimizer.state.get(entry.piece)
            if not state or "exp_avg" not in state:
                return False
            states.append(state)
        grads = self.owner.owned_grads(entries)  # host fp32, the offload's own buffers
        kernels = piece_kernels(optimizer)  # hyperparameters as of now
        torch._foreach_add_([state["step"] for state in states], 1)  # once per piece, as Adam's step does
        with only_params(optimizer, []):  # its hooks and patched counters (LR schedulers), once, here
            optimizer.step()
        by_part: dict[int, list[int]] = {}
        for position, entry in enumerate(entries):
            by_part.setdefault(id(entry.part), []).append(position)
        work = []
        for part in parts:
            handle = UpdateInFlight(self)
            part.update_in_flight = handle
            part.master_shards.written_back = True  # the thread writes every stepped piece back itself
            work.append((part, by_part.get(id(part), []), handle))
        self._parts = list(parts)
        self._error = None
        if self._pool is None:
            # One core fewer than the training thread's: torch's CPU kernels split their work evenly over their
            # threads, so one of them sharing a core with the training thread (a CUDA synchronise spins on its
            # core) would hold up the whole step, each chunk of it.
            threads = torch.get_num_threads()
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-overlapped-step",
                                            initializer=_use_threads, initargs=(max(1, threads - 1),))
            self._pool.submit(lambda: None).result()  # the thread has set its own count: now put back torch's
            torch.set_num_threads(threads)  # process-wide default, which setting a count also changes
        self.waited_seconds = 0.0
        self._flight = self._pool.submit(self._run, work, entries, states, grads, kernels, inv_scale, clip)
        self.overlapped_steps += 1
        return True

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self, work, entries: list[TileEntry], states: list, grads: list[torch.Tensor], kernels: dict,
             inv_scale: float, clip: Optional[torch.Tensor]) -> None:
        shards: list[torch.Tensor] = []
        start = time.perf_counter()
        try:
            for part, positions, handle in work:
                if self.owner.swapper is not None:  # nvme: tile by tile, each read in, stepped, written back, out
                    self._step_swapped(positions, entries, states, grads, kernels, inv_scale, clip)
                    handle.finish(None)
                    continue
                part_entries = [entries[i] for i in positions]
                if positions:
                    self._step_part(part_entries, [states[i] for i in positions], [grads[i] for i in positions],
                                    kernels, inv_scale, clip)
                handle.finish(self._write_back(part_entries, shards))
            self.thread_seconds = time.perf_counter() - start
            for device in {shard.device for shard in shards if shard.is_cuda}:  # before the next step changes
                _copy_stream(device).synchronize()  # the masters they read (not the compute stream: the forward)
        except BaseException as error:  # every waiter raises it (raise_error)
            self._error = error
            for _, _, handle in work:
                handle.finish(None)
            raise

    def _step_swapped(self, positions: list[int], entries: list[TileEntry], states: list, grads: list,
                      kernels: dict, inv_scale: float, clip: Optional[torch.Tensor]) -> None:
        """One part's pieces with ``device: nvme``, in tiles of at most ``sub_group_size`` elements as the inline
        step takes them: the next tile is read while this one steps, and this one's write overlaps the next."""
        owner, swap = self.owner, self.owner.swapper
        # swapped out between steps, a piece's tensor is empty: its size is the file's
        tiles = split_into_tiles(positions, lambda i: owner.numel_in_file(entries[i].piece), owner.sub_group_size)
        masters = lambda tile: [entries[i].piece for i in tile]  # noqa: E731
        reading = swap.swap_in(owner._swap_items(masters(tiles[0]))) if tiles else None
        writing = None
        try:
            for index, tile in enumerate(tiles):
                reading.wait()
                reading = None
                if index + 1 < len(tiles):
                    reading = swap.read_next(owner._swap_items(masters(tiles[index + 1])))
                self._step_part([entries[i] for i in tile], [states[i] for i in tile], [grads[i] for i in tile],
                                kernels, inv_scale, clip)
                write_back_pieces([entries[i] for i in tile])
                writing = swap.write_after(writing, owner._swap_items(masters(tile)))
        finally:
            if reading is not None:
                reading.wait()
            if writing is not None:
                writing.wait()

    def _step_part(self, entries: list[TileEntry], states: list, grads: list[torch.Tensor], kernels: dict,
                   inv_scale: float, clip: Optional[torch.Tensor]) -> None:
        """One part's pieces in chunks of at most ``chunk_numel`` (no copies around them here: the part is written
        back whole, after its last chunk), each unscaled and clipped just before its kernel."""
        plan = ChunkPlan([entry.piece for entry in entries], states, grads, kernels)
        scaled = inv_scale != 1.0 or clip is not None
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
        event.record(_copy_stream(device))
        return device, event

    # -- waiting ---------------------------------------------------------------------------------------------
    def raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(_FAILED) from self._error

    def settle(self) -> None:
        """Wait for the step in flight: the masters, their state and the model's shards are those after it."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
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

    def stop(self) -> None:
        try:
            self.settle()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
