"""The optimizer step of an offloaded engine: on host masters, with torch's fused CPU kernels, tile by tile.

The engine hands over, per step, one optimizer, its parts (flat groups or stage 3 units) and which of their
parameters got a gradient on some rank. Each part's master pieces were moved at setup to host memory
(host_masters.py), so the user's optimizer, whose param_groups hold those pieces, steps on the CPU. The pieces of
parameters that got a gradient are stepped in tiles of at most ``sub_group_size`` elements (a bigger piece is a
tile of its own); the others keep ``grad=None`` and are left alone, as without offload. Reduced gradient shards
come from host buffers (host_grads.py: copied during backward, or tile by tile here), unscaled and clipped; fp32
shards already in host memory are used in place. With ``device: nvme`` a tile's pieces and their state are read
from the swap file before it steps (the next tile's read overlaps this tile's step), written back to the model's
parameter shards, and written out again (overlapping the next tile's step); what is swapped, and reading it
outside the step, is swapped_state.py's. The step overlapped with the forward or started during backward is
overlapped_step.py's, the delayed update delayed_update.py's.
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from zero_core.optim.kernels import FUSED_CPU, fused_sgd_would_fail, only_params
from zero_core.optim.master_shards import master_tiles, tile_runs, unscale_and_clip
from zero_core.offload import compiled_adam, nvme_slices
from zero_core.offload.aio import AioPool, Transfer
from zero_core.offload.chunked_step import (CHUNK_MAX, Span, chunk_numel, chunked_adam_step, grad_factor,
                                            steps_fused_adam)
from zero_core.offload.delayed_update import DelayedUpdate
from zero_core.offload.host_masters import HostMasterShards, write_back_pieces
from zero_core.offload.host_grads import HostGrads
from zero_core.offload.nvme_grads import NvmeGrads
from zero_core.offload.nvme_swap import NVME_TILE_NUMEL, NvmeSwapper, check_nvme_path
from zero_core.offload.overlapped_step import OverlappedStep
from zero_core.offload.params import offload_param_shards
from zero_core.offload.placement import copy_all, pinning, wait_for_copies
from zero_core.offload.swapped_state import SwappedState

# Bytes per master element a swap file needs, counting Adam's two moments and (at most fp32) the gradient written
# out during backward (nvme_grads.py): the pre-flight disk check.
_SWAP_BYTES_PER_ELEMENT = 4 * 3 + 4


class _Pipeline:
    """Device 'cpu': the copies around the step run on one thread, in order, while the main thread steps (torch's
    copies release the GIL): the next tile's gradients come in while this tile steps, and each tile's updated
    masters go back into the model's parameter shards (cast to their dtype, one copy per run of contiguous
    pieces) while the next tile steps. The parts' own write-back after the step then has nothing left to do."""

    def __init__(self, pool: Optional[ThreadPoolExecutor]) -> None:
        self.pool = pool  # None (aio.overlap_events false): every copy runs at once, on the training thread
        self.pending: list[Future] = []
        self.parts: dict = {}

    def submit(self, copies: list[tuple], arrive: bool = False) -> Optional[Future]:
        if not copies or self.pool is None:
            copy_all(copies, arrive)
            return None
        future = self.pool.submit(copy_all, copies, arrive)
        self.pending.append(future)
        return future

    def write_back(self, tile: list[tuple]) -> None:
        copies = []
        for part, bucket, start, end, _ in tile_runs(tile):
            if part.swap is not None:
                continue  # parameter shards swapped to NVMe: written back by the part, after the step
            master = part.master_shards.buckets[bucket][start:end]
            shard = part.param_shards()[bucket][start:end]
            self.parts[id(part)] = part
            if shard.data_ptr() != master.data_ptr():
                copies.append((shard, master))
        self.submit(copies)

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def finish(self) -> None:
        """Every tile was written back: the parts' own write-back after the step is skipped once."""
        for part in self.parts.values():
            part.master_shards.written_back = True


class OptimizerOffload:
    """Host-resident (or NVMe-swapped) master pieces and state, and the tiled CPU step over them."""

    def __init__(self, parts: list, config, rank: int, update_order: Optional[Callable[[list], list]] = None) -> None:
        block = config.offload_optimizer
        self.device = block.device
        self.sub_group_size = config.sub_group_size
        if block.device == "nvme":  # a few tiles in memory at the step, not the whole state (nvme_swap.py)
            self.sub_group_size = min(self.sub_group_size, NVME_TILE_NUMEL)
        # Elements per chunk of the Adam/AdamW step on device 'cpu', at most (chunked_step.py): a step with copies
        # is cut by chunk_numel(), below this; the overlapped step (no copies per chunk) steps chunks of this size
        self.chunk_numel = CHUNK_MAX
        self.chunks_stepped = 0  # chunks stepped by the chunked Adam path so far (a counter)
        self.slices_stepped = 0  # NVMe: slices of pieces bigger than a tile stepped so far (a counter)
        # The chunked Adam path: None, where the shards are on an accelerator; True / False: always / never
        self.chunked: Optional[bool] = None
        # offload_optimizer.host_kernel 'compiled' (compiled_adam.py): the host gradient buffers keep the gradients'
        # dtype and every Adam/AdamW step with state runs the compiled kernel in chunks (_step), on a CPU-only run
        # too
        self.compiled = block.host_kernel == "compiled"
        nvme = self.device == "nvme"
        numel = sum(m.numel() for part in parts for m in part.masters)
        if nvme:
            check_nvme_path(block.nvme_path, "zero_optimization.offload_optimizer.nvme_path",
                            _SWAP_BYTES_PER_ELEMENT * numel)
        # Resizing storage (the swap) needs ordinary host memory, so pinning is for device 'cpu' only.
        self.pin = pinning(block.pin_memory) and not nvme
        self.parts: list = []
        self._noted: set[type] = set()
        self.swapper: Optional[NvmeSwapper] = None
        self._write_pool: Optional[ThreadPoolExecutor] = None
        # Device 'cpu': whether the copies around the step run on a thread (None: where they are transfers to and
        # from an accelerator, when aio.overlap_events allows; see _copy_thread).
        self.copy_thread: Optional[bool] = None if config.aio.overlap_events else False
        if nvme:
            # Freed tile buffers kept for reuse: buffer_count tiles of a master and Adam's two moments.
            pool_bytes = block.buffer_count * 3 * 4 * min(self.sub_group_size, numel)
            self.swapper = NvmeSwapper(block.nvme_path, rank, AioPool.from_config(config.aio), pool_bytes)
        self.swapped = SwappedState(self.swapper, self.sub_group_size)  # swapped_state.py
        # The reduced gradients: host buffers (cpu), or the swap file during backward (nvme; nvme_grads.py, with
        # staging in flight bounded by the swap's pool of tile buffers)
        written = None if self.swapper is None else NvmeGrads(self.swapper, pinning(block.pin_memory),
                                                                 self.swapper.pool_bytes)
        self.grads = HostGrads(self.pin, self.compiled, config.fp16.enabled, written)  # host_grads.py
        after = block.delayed_update_after
        self.delayed: Optional[DelayedUpdate] = None if after is None else DelayedUpdate(self, after)
        # The step overlapped with the next forward (overlapped_step.py): None, where the shards are on an
        # accelerator; True / False: always / never (offload_optimizer.overlap_with_forward; tests force True)
        forward = block.overlap_with_forward
        if forward is None:  # the default: stage 3, device cpu. Not with nvme, whose gradients would wait in host
            # memory for the step; not at stages 1-2, whose step call all-gathers every group after the step, so
            # the forward cannot start early and the inline step's write-back beside its chunks is the faster
            forward = block.device == "cpu" and config.stage == 3
        self.overlap: Optional[bool] = None if forward or block.overlap_with_backward else False
        # offload_optimizer.overlap_with_backward (device cpu): a part's step starts once backward reduced it
        self.overlapped = OverlappedStep(self, with_backward=block.overlap_with_backward and self.swapper is None)
        self.update_order = update_order or list  # the runtime's: parts in the order the next forward reads them
        self.adopt(parts)

    def adopt(self, parts: list) -> None:
        """Move the masters of ``parts`` (at setup, or made trainable later) to the host; with NVMe, write them
        out one piece at a time (only one is in memory at once)."""
        if self.compiled:  # the kernel for these parts' gradient dtype, built now (compiled_adam.py)
            writes = any(part.swap is None and any(map(self._kernel_writes, part.param_shards())) for part in parts)
            compiled_adam.warm_up(compiled_adam.FIELD, {part.dtype for part in parts}, writes)
        for part in parts:
            part.on_grad_reduced = self.grad_reduced  # (nvme: written to the file where memory is given back)
            # With the delayed update a master is never the model's shard itself: the thread changes the masters
            # while the next forward reads the shards.
            store = None if self.swapper is None else self._store
            part.master_shards = HostMasterShards(part.master_shards, self.pin, self.swapper is not None, store,
                                                  own_copy=self.delayed is not None)
            self.parts.append(part)

    def _store(self, source: torch.Tensor) -> nn.Parameter:
        """The master piece of ``source`` (a 16-bit or fp32 piece of a shard), written to the swap file in fp32 a
        slice at a time and swapped out: setup holds a slice, not the piece (nvme_slices.py)."""
        piece = nn.Parameter(torch.empty(0, dtype=torch.float32))
        nvme_slices.write_in_slices(self.swapper, piece, source, self.sub_group_size)
        return piece

    def settle(self, reading: bool = True) -> None:
        """A delayed update in flight (``delayed_update_after``) lands: the masters and optimizer state are those
        after the last step. The model's parameters may still lag them: see :meth:`take_unwritten`. Between a
        backward that started units' steps (``overlap_with_backward``) and the step call the masters are neither
        before nor after the step: a caller ``reading`` them then gets an error (the step call still completes
        the step); ``engine.close()`` only waits."""
        started = self.overlapped.started_in_backward()
        self.overlapped.settle()
        if started and reading:
            raise RuntimeError(
                f"offload_optimizer.overlap_with_backward started the step of {started} parts during backward, so "
                "between backward and step() the optimizer's masters and state are partly updated: read them (a "
                "checkpoint, a full state dict, the debugging API) before backward or after step(), or set "
                "overlap_with_backward: false")
        if self.delayed is not None:
            self.delayed.settle()

    def take_unwritten(self) -> bool:
        """Whether a landed delayed update is not in the model's parameters yet (forgotten: the caller writes
        every master into the model)."""
        return self.delayed is not None and self.delayed.take_unwritten()

    def all_masters(self) -> list[nn.Parameter]:
        return [m for part in self.parts for m in part.masters]

    def close(self) -> None:
        """Remove the swap file (also done when the engine is collected and at exit); stop the write-back thread."""
        self.overlapped.stop()
        if self.delayed is not None:
            self.delayed.stop()
        self.grads.finish()
        if self.swapper is not None:
            self.swapper.close()
        self._stop_writer()

    def teardown(self) -> None:
        """The engine's teardown: the swap file's name leaves ``nvme_path`` and every thread stops; the engine
        stays usable (the open file and the threads serve a later step, save or evaluation)."""
        self.overlapped.stop()
        if self.delayed is not None:
            self.delayed.stop()
        self.grads.finish()
        if self.swapper is not None:
            self.swapper.teardown()
        self._stop_writer()

    def _stop_writer(self) -> None:
        if self._write_pool is not None:
            self._write_pool.shutdown()
            self._write_pool = None

    # -- the user's optimizer on the CPU -------------------------------------------------------------------
    def use_fused(self, optimizer: torch.optim.Optimizer) -> None:
        """Run torch's fused CPU kernel when the optimizer has one; any other optimizer steps as written."""
        if isinstance(optimizer, FUSED_CPU) and "fused" in optimizer.defaults:
            optimizer.defaults["fused"] = True
            for group in optimizer.param_groups:
                if not group.get("differentiable"):
                    # this step only, while its parameters' momentum buffers are mixed (kernels.py)
                    fused = not fused_sgd_would_fail(optimizer, group)
                    group["fused"], group["foreach"] = fused, False
        elif type(optimizer) not in self._noted:
            self._noted.add(type(optimizer))
            warnings.warn(
                f"offload_optimizer: {type(optimizer).__name__} has no fused CPU kernel in torch, so its step runs "
                "torch's generic code on the CPU (slower). Adam, AdamW, SGD and Adagrad step with fused kernels.",
                stacklevel=5,
            )

    def grad_reduced(self, part, bucket: Optional[int]) -> None:
        """The reducer finished ``bucket`` of ``part`` (None: all of them): its copy to the host starts now
        (host_grads.py), and overlap_with_backward may start its step."""
        self.overlapped.settle_previous()  # the last step's update reads these buffers
        self.grads.copy_reduced(part, bucket)
        self.overlapped.start_early(part, bucket)

    def forget_grads(self, parts: Optional[list] = None) -> None:
        """The gradient shards of ``parts`` (None: all) were zeroed (a step, zero_grad, a skipped fp16 step): no
        host copy is current."""
        self.grads.forget(parts)
        started = self.overlapped.started_in_backward()
        if started:
            self.overlapped.discard_early()
            raise RuntimeError(
                f"offload_optimizer.overlap_with_backward started the step of {started} parts during backward, "
                "and the gradients were zeroed without step(): those parts are updated. It needs step() after "
                "every backward that reduces; set overlap_with_backward: false for a loop that skips steps")

    def step(self, optimizer: torch.optim.Optimizer, parts: list, used: list[list[bool]], inv_scale: float,
             clip_coef: Optional[torch.Tensor]) -> None:
        """Copy the gradients to the host, step ``optimizer`` tile by tile, write each tile back (NVMe: and out).
        Starts once the copies made during backward have arrived; returns once every write-back reached the
        model's parameter shards, so the next forward reads them and the next step may change the masters they
        were copied from."""
        self.overlapped.settle_previous()  # the step before (another optimizer's) has landed
        on_accelerator = [part.grad_view(0) for part in parts]
        wait_for_copies(on_accelerator)  # the gradients copied out during backward (copy stream) have arrived
        if self.delayed is not None and self.delayed.takes(optimizer):
            self.use_fused(optimizer)
            clip = clip_coef.detach().float().cpu() if clip_coef is not None else None
            # on a thread; the last update's copies into the model are waited for by their readers, not here
            self.delayed.step(optimizer, parts, used, inv_scale, clip)  # (delayed_update.py)
            return
        try:
            self.use_fused(optimizer)
            self.check_kernel(optimizer)
            if self.overlapped.applies(optimizer, parts, self.overlap):
                mask = {id(part): flags for part, flags in zip(parts, used)}
                ordered = self.update_order(parts)
                clip = clip_coef.detach().float().cpu() if clip_coef is not None else None
                self.overlapped.remember(optimizer, parts, inv_scale, clip)
                if self.overlapped.start(optimizer, ordered, [mask[id(p)] for p in ordered], inv_scale, clip):
                    return  # on a thread; each part's next reader waits for its update (overlapped_step.py)
            self._step(optimizer, parts, used, inv_scale, clip_coef)
        finally:
            wait_for_copies(on_accelerator)

    def _step(self, optimizer: torch.optim.Optimizer, parts: list, used: list[list[bool]], inv_scale: float,
              clip_coef: Optional[torch.Tensor]) -> None:
        self.use_fused(optimizer)
        clip = clip_coef.detach().float().cpu() if clip_coef is not None else None
        tiles = master_tiles(parts, used, self.sub_group_size)
        swap = self.swapper
        # Chunks serve the copies to and from an accelerator (they overlap the neighbouring chunks' step, and the
        # last chunk's write-back is all that is left after the kernel); on a CPU-only run they were measured no
        # faster at one thread and slower at two (docs/benchmarks.md), so tiles step whole. The compiled kernel
        # runs only there (the chunked path), on a CPU-only run too.
        chunked = self.compiled or (self._on_accelerator(parts) if self.chunked is None else self.chunked)
        if swap is None and chunked and steps_fused_adam(optimizer) and self._step_chunked(optimizer, tiles,
                                                                                          inv_scale, clip):
            return
        # NVMe: a tile that is one piece bigger than the tile steps slice by slice (nvme_slices.py)
        cut = [nvme_slices.sliced(optimizer, swap, tile, self.sub_group_size) for tile in tiles] if swap else []

        def items(index: int) -> list:  # what the tile loop swaps in and out for tile ``index``
            return [] if cut[index] else list(self.swapped.items(m for m, *_ in tiles[index]))

        def grads_ahead(index: int):  # tile ``index``'s gradients in the file, read beside its masters
            return None if cut[index] else self.grads.read_ahead(tiles[index])

        reading = swap.swap_in(items(0)) if swap and tiles else None
        ahead = grads_ahead(0) if swap and tiles else None
        writing: Optional[Transfer] = None
        pipe = _Pipeline(self._writer() if self._copy_thread(parts) else None) if swap is None else None
        threaded = pipe is not None and pipe.pool is not None
        upcoming = self.grads.fetch(tiles[0], None)[0] if threaded and tiles else None
        try:
            for index, tile in enumerate(tiles):
                arriving = None
                if swap is not None:
                    reading.wait()
                    if cut[index]:
                        if writing is not None:  # the last tile's buffers go before the slices come in
                            writing.wait()
                            writing = None
                        self._step_sliced(optimizer, tile[0], inv_scale, clip)
                        if index + 1 < len(tiles):
                            reading = swap.read_next(items(index + 1))
                            ahead = grads_ahead(index + 1)
                        continue
                    current, ahead = ahead, None
                    if index + 1 < len(tiles):  # read the next tile while this one steps
                        reading = swap.read_next(items(index + 1))
                        ahead = grads_ahead(index + 1)
                if not threaded:  # just before the step (NVMe: only this tile's, read ahead from the file)
                    grads = self.grads.fetch(tile, None, current if swap is not None else None)[0]
                else:
                    grads = upcoming
                    if index + 1 < len(tiles):  # the next tile's gradients come in while this one steps
                        upcoming, arriving = self.grads.fetch(tiles[index + 1], pipe)
                if self.compiled:  # a first step (state created) or new pieces: torch's step takes fp32
                    grads = [grad.float() for grad in grads]
                unscale_and_clip(grads, inv_scale, clip)  # the same arithmetic as step_in_tiles
                for (piece, *_), host in zip(tile, grads):
                    piece.grad = host.view(piece.shape)
                with only_params(optimizer, [piece for piece, *_ in tile]):
                    optimizer.step()
                for piece, *_ in tile:
                    piece.grad = None
                if pipe is not None:
                    pipe.write_back(tile)  # while the next tile steps
                    if arriving is not None:
                        arriving.result()  # queued before this write-back: it does not wait for it
                    continue
                write_back_pieces(tile)  # the write-back after the step skips swapped-out pieces
                writing = swap.write_after(writing, items(index))
        finally:
            if pipe is not None:
                pipe.wait()
        if pipe is not None:
            pipe.finish()
        if writing is not None:
            writing.wait()
        self.grads.consumed()  # by the step (the engine zeroes the shards next, and forget_grads follows)

    def _step_sliced(self, optimizer: torch.optim.Optimizer, entry: tuple, inv_scale: float,
                     clip: Optional[torch.Tensor]) -> None:
        """NVMe: one piece bigger than the tile, read, stepped, written back and written out slice by slice, its
        gradient copied to the host (or read from the swap file) a slice at a time (nvme_slices.py)."""
        piece, grad, part, index = entry
        in_file = self.grads.in_file(part, index)  # written out during backward (nvme_grads.py)
        in_place = self.grads.in_place(grad) and not in_file
        cuts = nvme_slices.slices(grad.numel(), self.sub_group_size)  # (64-element multiples: maybe over the tile)
        longest = max(end - start for start, end in cuts)
        buffer = None if in_place else torch.empty(longest, dtype=torch.float32)
        # the gradient's slices from the file, each read while the slice before steps
        from_file = self.grads.piece_slices(part, index, cuts) if in_file else None

        def grad_slice(start: int, end: int) -> torch.Tensor:
            if in_place:
                return grad[start:end]  # fp32 in host memory: unscaled in place, as a tile's
            host = buffer[: end - start]
            if from_file is not None:
                from_file.into(start, end, host)
            else:
                copy_all([(host, grad[start:end])], arrive=True)
            return host

        with part.shard_in_memory():
            target = part.master_shards.piece_shard(part.param_shards(), index)

            def write_back(start: int, end: int, master: torch.Tensor) -> None:
                target[start:end].copy_(master)

            self.slices_stepped += nvme_slices.step_in_slices(optimizer, self.swapper, piece, grad_slice, write_back,
                                                              inv_scale, clip, self.sub_group_size)

    def _step_chunked(self, optimizer: torch.optim.Optimizer, tiles: list[list[tuple]], inv_scale: float,
                      clip: Optional[torch.Tensor]) -> bool:
        """Device 'cpu' with Adam/AdamW, shards on an accelerator: every stepped piece in chunks smaller than a
        piece, each chunk's gradient copies before it and its write-back after it, overlapping the next chunks
        (asynchronous from pinned memory, else on the copy thread; chunked_step.py). False where a piece has no
        state yet (first step)."""
        entries = [entry for tile in tiles for entry in tile]
        grads = self.grads.pieces(entries)
        copies, writes, parts, offset = [], [], {}, 0
        outs = self._direct_outs(entries) if self.compiled else None
        for part, bucket, start, end, _ in tile_runs(entries):
            if self.grads.stale(part, bucket):
                copies.append(Span(offset, self.grads.buffers[(id(part), bucket)][start:end],
                                   part.grad_shards()[bucket][start:end]))
            if part.swap is None:  # else the parameter shards are on NVMe: the part writes back after the step
                parts[id(part)] = part
                master, shard = part.master_shards.buckets[bucket][start:end], part.param_shards()[bucket][start:end]
                if shard.data_ptr() != master.data_ptr() and not self._kernel_writes(shard):
                    writes.append(Span(offset, shard, master.detach()))
            offset += end - start
        # Nothing to copy (fp32 host shards, their own masters): one chunk, no thread; chunks only add calls.
        # Else chunks that balance their fixed cost against the last one's write-back (chunk_numel()).
        moving = bool(copies or writes)
        pool = self._writer() if moving and self._copy_thread([entry.part for entry in entries]) else None
        scale = None if inv_scale == 1.0 and clip is None else lambda chunk: unscale_and_clip(chunk, inv_scale, clip)
        factor = 1.0
        if self.compiled:  # the kernel scales as it reads (16-bit gradients, some the model's own, stay as they are)
            scale, factor = None, grad_factor(inv_scale, clip)
        chunks = chunked_adam_step(optimizer, [entry.piece for entry in entries], grads, copies, writes, scale, pool,
                                   chunk_numel(offset, self.chunk_numel) if moving else offset,
                                   compiled=self.compiled, grad_scale=factor, outs=outs)
        if not chunks:
            return False
        self.chunks_stepped += chunks
        for part in parts.values():
            part.master_shards.written_back = True  # the parts' own write-back after the step is skipped once
        self.grads.consumed()
        return True

    def _kernel_writes(self, shard: torch.Tensor) -> bool:
        """Whether the compiled kernel writes ``shard`` (a model's parameter shard) itself as it steps: a separate
        16-bit tensor in host memory (a CPU-only run, or offload_param cpu); else a copy writes it back."""
        return self.compiled and shard.device.type == "cpu" and shard.dtype != torch.float32

    def _direct_outs(self, entries: list) -> list[Optional[torch.Tensor]]:
        """The compiled kernel's own write-back: per entry, its flat view of the model's parameter shard where the
        kernel writes it (_kernel_writes), else None."""
        outs = []
        for entry in entries:
            fragment = entry.part.master_shards.pieces[entry.index]
            shard = None if entry.part.swap is not None else entry.part.param_shards()[fragment.bucket]
            direct = shard is not None and self._kernel_writes(shard)
            outs.append(shard[fragment.shard_range.as_slice()] if direct else None)
        return outs

    def check_kernel(self, optimizer: torch.optim.Optimizer) -> None:
        """host_kernel 'compiled' steps torch's Adam/AdamW only: any other optimizer is an error that says so."""
        if self.compiled:
            problem = compiled_adam.refusal(optimizer, compiled_adam.FIELD)
            if problem is not None:
                raise ValueError(problem)

    @staticmethod
    def _on_accelerator(parts: list) -> bool:
        return any(part.grad_view(0).device.type != "cpu" for part in parts)

    def _copy_thread(self, parts: list) -> bool:
        """Whether the copies around the step run on a thread. Host <-> accelerator copies from pinned memory are
        asynchronous (placement.py): issued inline they overlap the step already, and a thread only adds GIL
        hand-offs (12% of a fused step on an H200 host, benchmarks.gpu_host_step). From pageable memory they
        block until done, and on a thread they overlap the step. When the model's shards are host memory too (a
        CPU-only run) the casts compete with the step for the same cores and memory bandwidth, and a thread was
        measured no faster (docs/benchmarks.md), so they run inline."""
        if self.copy_thread is not None:
            return self.copy_thread
        return self._on_accelerator(parts) and not self.pin

    def _writer(self) -> ThreadPoolExecutor:
        """One thread for the write-backs (torch's copies release the GIL, so they overlap the next tile)."""
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-writeback")
        return self._write_pool

    # -- the state outside the step (swapped_state.py) -----------------------------------------------------
    def stream(self, masters: list, write: bool = False) -> Iterator[list]:
        """``masters`` a few tiles at a time, with their optimizer state (SwappedState.stream). A delayed update in
        flight lands first."""
        self.settle()
        yield from self.swapped.stream(masters, self.parts, write)

    @contextlib.contextmanager
    def resident(self, masters: Optional[list] = None, state: bool = True, write: bool = True) -> Iterator[None]:
        """Everything, or only ``masters``, in memory for the duration (SwappedState.resident). A delayed update in
        flight lands first."""
        self.settle()
        with self.swapped.resident(self.all_masters, masters, state, write):
            yield


def attach(runtime, config, rank: int) -> Optional[OptimizerOffload]:
    """Offload ``runtime``'s parameter shards and masters as the config asks (before the optimizers are narrowed
    to the masters)."""
    offload_param_shards(runtime, runtime.units, config, rank)
    block = config.offload_optimizer
    if block is None or block.device == "none":
        return None
    return OptimizerOffload(runtime.parts, config, rank, runtime.update_order)


def adopt(runtime, parts: list, config, offload: Optional[OptimizerOffload]) -> None:
    """Parts that became trainable after setup (add_param_group, unfreezing) are offloaded like the others
    (stage 3 rebuilt their units: every unit not offloaded yet is)."""
    offload_param_shards(runtime, runtime.units, config, runtime.comm.topology.rank)
    if offload is not None:
        offload.adopt(parts)
