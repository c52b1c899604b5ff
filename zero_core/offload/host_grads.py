"""The host gradient buffers of an offloaded step: one per reduce bucket shard, in the dtype the host kernel reads.

With device ``cpu`` each bucket's reduced gradient shard is copied into its buffer as soon as the reducer is done
with it (during backward), and the accelerator's copy then gives its memory back (grad_memory.py); what backward did
not copy is copied when a step asks for it, one copy per run of contiguous pieces. With ``nvme`` only the stepping
tile's gradients are in host memory: each bucket is written to the swap file as it is reduced, where the
accelerator's copy is given back (nvme_grads.py), and read back by the step tile by tile; else copied from the
accelerator at the step. fp32 shards already in host memory (a CPU-only run) are read where they are. The step
(cpu_optimizer.py), the overlapped step (overlapped_step.py) and the delayed update (delayed_update.py) read their
gradients from here.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import NamedTuple, Optional, Protocol

import torch

from zero_core.optim.master_shards import tile_runs
from zero_core.offload.aio import Transfer
from zero_core.offload.nvme_grads import NvmeGrads
from zero_core.offload.placement import _copy_stream, copy_all, copy_between, host_empty


class CopyQueue(Protocol):
    """Where a tile's gradient copies run: on the step's copy thread (cpu_optimizer._Pipeline)."""

    def submit(self, copies: list[tuple], arrive: bool = False) -> Optional[Future]: ...


class ReadAhead(NamedTuple):
    """A tile's gradients being read from the swap file (nvme): by position in the tile, a buffer in the
    gradient's dtype, filled once ``transfer`` is waited."""

    reads: dict[int, torch.Tensor]
    transfer: Transfer


class HostGrads:
    """Host buffers of the reduced gradient shards, which of them hold the latest reduction, and their copies."""

    def __init__(self, pin: bool, compiled: bool, fp16: bool, nvme: Optional[NvmeGrads] = None) -> None:
        self.pin = pin  # page-locked buffers (device 'cpu' with CUDA)
        # device 'nvme': only the stepping tile's gradients are in host memory, and backward writes them to the
        # swap file where gradient memory is given back
        self.nvme = nvme
        self.compiled = compiled  # host_kernel 'compiled': buffers keep the gradients' dtype (compiled_adam.py)
        self.buffers: dict[tuple, torch.Tensor] = {}  # (id(part), bucket) -> host gradient buffer (device 'cpu')
        # Buckets whose host buffer holds the latest reduced gradient: with device 'cpu' each bucket is copied to
        # the host as soon as it is reduced (during backward), so the step need not wait for the copy.
        self.fresh: set[tuple] = set()
        # Gradient buffers a delayed update read, free again (offload_optimizer.delayed_update_after): with the
        # delay, one set is filled by backward while the update of the step before reads the other.
        self.spare: dict[tuple, torch.Tensor] = {}
        self.copied_during_backward = 0  # buckets copied to the host as they were reduced (a counter)
        self.moved_to_host = 0  # reduced gradient shards whose accelerator memory went after their copy (a counter)
        self.read_ahead_pieces = 0  # nvme: pieces whose gradient was read from the file ahead of its tile (a counter)
        # The norms a moved shard keeps (_move_to_host): clipping's 2-norm, and fp16's overflow check's max
        self.norm_types = (2.0, math.inf) if fp16 else (2.0,)

    @property
    def swapped(self) -> bool:
        """Device 'nvme': only the stepping tile's gradients are in host memory."""
        return self.nvme is not None

    def dtype(self, grad: torch.Tensor) -> torch.dtype:
        """The dtype the host step reads ``grad`` in: fp32 for torch's fused kernel, its own for the compiled one."""
        return grad.dtype if self.compiled else torch.float32

    def in_place(self, grad: torch.Tensor) -> bool:
        """Whether the step reads ``grad`` where it is (in host memory already, in the dtype the kernel takes)."""
        return grad.device.type == "cpu" and grad.dtype == self.dtype(grad)

    def stale(self, part, bucket: int) -> bool:
        """Whether ``bucket`` of ``part`` must be copied before a step reads it (backward did not copy it)."""
        return not self.in_place(part.grad_view(bucket)) and (id(part), bucket) not in self.fresh

    def consumed(self) -> None:
        """A step read the host copies: the next one copies again (what the swap file holds stays readable until
        the shards are zeroed: :meth:`forget`)."""
        self.fresh.clear()

    def forget(self, parts: Optional[list] = None) -> None:
        """The gradient shards were zeroed: no host copy is current, nor is what the swap file holds of ``parts``'s
        (None: all; another optimizer's parts keep theirs)."""
        self.fresh.clear()
        if self.nvme is not None:
            self.nvme.forget(parts)

    def finish(self) -> None:
        """Writes of gradients to the swap file still under way land, and their thread stops (teardown: a write
        that failed was raised at its reader already, or will not be read)."""
        if self.nvme is not None:
            self.nvme.finish(raise_errors=False)

    def in_file(self, part, index: int) -> bool:
        """Whether piece ``index`` of ``part`` has its gradient in the swap file (nvme_grads.py)."""
        return self.nvme is not None and self.nvme.holds(part, part.master_shards.pieces[index].bucket)

    def read_piece(self, part, index: int, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of piece ``index``'s gradient, from the swap file, into ``out`` (cast)."""
        fragment = part.master_shards.pieces[index]
        self.nvme.read(part, fragment.bucket, fragment.shard_range.start + start, fragment.shard_range.start + end,
                       out)

    def piece_slices(self, part, index: int, cuts: list[tuple[int, int]]) -> "PieceSlices":
        """nvme: piece ``index``'s gradient from the swap file in the slices ``cuts`` of a sliced step, the next
        slice read while the caller steps one (nvme_slices.py)."""
        return PieceSlices(self, part, index, cuts)

    def bucket(self, part, bucket: int, like: torch.Tensor) -> torch.Tensor:
        """The host gradient buffer of one bucket shard ``like`` (device 'cpu': kept; 'nvme': only for this tile),
        in the dtype the kernel takes (:meth:`dtype`)."""
        dtype = self.dtype(like)
        if self.swapped:  # only the tile's gradients are in memory
            return torch.empty(like.numel(), dtype=dtype)
        key = (id(part), bucket)
        grad = self.buffers.get(key)
        if grad is None:
            grad = self.spare.pop(key, None)
            if grad is None:
                grad = host_empty(like.numel(), dtype, self.pin)
            self.buffers[key] = grad
        return grad

    def take(self, entries: list) -> tuple[list[torch.Tensor], dict]:
        """The delayed update's gradients: each entry's fp32 host gradient, in buffers handed over with them
        (the next backward copies into others). What backward did not copy yet is copied now, one copy per run
        of contiguous pieces; fp32 host shards too, since the next backward overwrites them."""
        taken: dict[tuple, torch.Tensor] = {}
        copies = []
        for part, bucket, start, end, _ in tile_runs(entries):
            key = (id(part), bucket)
            whole = part.grad_view(bucket)
            if key not in taken:
                taken[key] = self.bucket(part, bucket, whole)
                del self.buffers[key]
            if key not in self.fresh:
                copies.append((taken[key][start:end], part.grad_shards()[bucket][start:end]))
        copy_all(copies, arrive=True)
        self.fresh.difference_update(taken)
        return self._per_entry(entries, taken), taken

    def owned(self, entries: list, consume: bool = True) -> list[torch.Tensor]:
        """The overlapped step's gradients: each entry's fp32 host gradient in a buffer of the offload's own (the
        step reads them after the step call returned and the engine zeroed the gradient shards). What backward
        copied already is used as it is; the rest (fp32 host shards too) is copied now, one copy per run of
        contiguous pieces. The next backward copies into the same buffers once the step has landed."""
        copies, buffers = [], {}
        for part, bucket, start, end, _ in tile_runs(entries):
            key = (id(part), bucket)
            whole = part.grad_view(bucket)
            if key not in buffers:  # nvme: a buffer of its own per bucket (the gradients wait in host memory)
                buffers[key] = self.bucket(part, bucket, whole)
            if self.nvme is not None and self.nvme.holds(part, bucket):
                self.nvme.read(part, bucket, start, end, buffers[key][start:end])
            elif self.swapped or key not in self.fresh:
                copies.append((buffers[key][start:end], part.grad_shards()[bucket][start:end]))
        copy_all(copies, arrive=True)
        if consume:
            self.fresh.clear()  # consumed by this step (not by a part backward starts early: the rest follow)
        return self._per_entry(entries, buffers)

    @staticmethod
    def _per_entry(entries: list, buffers: dict) -> list[torch.Tensor]:
        grads = []
        for entry in entries:
            fragment = entry.part.master_shards.pieces[entry.index]
            grads.append(buffers[(id(entry.part), fragment.bucket)][fragment.shard_range.as_slice()])
        return grads

    def give_back(self, buffers: dict) -> None:
        """Buffers a delayed update has finished reading: for the next backward's copies."""
        self.spare.update(buffers)

    def copy_reduced(self, part, bucket: Optional[int]) -> None:
        """The reducer finished ``bucket`` of ``part`` (None: all of them): start its copy to the host now, so it
        overlaps the rest of backward, and let the accelerator's copy go. Later reductions (accumulation) copy
        again; the last one is what steps."""
        # Only the buckets just reduced (a stage 2 group's others may hold no memory, and keep it that way)
        indices = range(len(part.layout.buckets)) if bucket is None else (bucket,)
        shards = [part.grad_view(index) for index in indices]
        if self.swapped:
            self._write_reduced(part, list(indices), shards, bucket)
            return
        hosts: list[Optional[torch.Tensor]] = []
        for index, grad in zip(indices, shards):
            if self.in_place(grad) or grad.numel() == 0:
                hosts.append(None)
                continue  # used in place at the step
            host = self.bucket(part, index, grad)
            copy_between(host, grad)
            hosts.append(host)
            self.fresh.add((id(part), index))
            self.copied_during_backward += 1
        if any(host is not None for host in hosts) and all(
                host is not None or grad.numel() == 0 for host, grad in zip(hosts, shards)):
            self._move_to_host(part, shards, hosts, bucket)

    def _write_reduced(self, part, indices: list[int], shards: list[torch.Tensor], bucket: Optional[int]) -> None:
        """nvme: the reduced shards written to the swap file and their accelerator memory given back, where
        gradient memory is given back (else the step copies them tile by tile, as they are)."""
        filled = [(index, shard) for index, shard in zip(indices, shards) if shard.numel()]
        if not filled or not part.releases_grad(bucket):
            return  # (stage 2's lent bucket, a CPU-only run): the step copies it from the shard
        for index, shard in filled:
            self.nvme.put(part, index, shard)
        device = filled[0][1].device
        in_use = _copy_stream(device, to_device=False) if device.type == "cuda" else None
        nvme = self.nvme

        def copy_in(views: list[torch.Tensor]) -> None:  # returns once the values are back (a rare read)
            pairs = [(index, view) for index, view in zip(indices, views) if view.numel()]
            nvme.copy_in(part, [index for index, _ in pairs], [view for _, view in pairs])

        part.grads_to_host(copy_in, self.norm_types, in_use, bucket)  # (releases_grad said it gives it back)
        self.moved_to_host += 1

    def _move_to_host(self, part, shards: list[torch.Tensor], hosts: list[Optional[torch.Tensor]],
                      bucket: Optional[int]) -> None:
        """``part``'s reduced gradient (``bucket``, or None: every bucket, stage 3) is on its way to the host: the
        accelerator's copy gives its memory back (where gradient memory is released, grad_memory.py), keeping the
        bucket norms that clipping and fp16's overflow check read. A reader that needs the shard again (an
        accumulating reduction, the debugging API) gets the host's values copied back in."""
        device = shards[0].device
        in_use = _copy_stream(device, to_device=False) if device.type == "cuda" else None

        def copy_in(views: list[torch.Tensor]) -> None:  # returns once the values are back (a rare read)
            if in_use is not None:
                in_use.synchronize()  # the copies to the host have landed
            for view, host in zip(views, hosts):
                if host is not None:
                    copy_between(view, host)
            if in_use is not None:
                _copy_stream(device, to_device=True).synchronize()

        if part.grads_to_host(copy_in, self.norm_types, in_use, bucket):
            self.moved_to_host += 1

    def pieces(self, entries: list) -> list[torch.Tensor]:
        """Each entry's host gradient where backward copies it (device 'cpu'), or the gradient itself where the
        step reads it in place."""
        out = []
        for _, grad, part, index in entries:
            if self.in_place(grad):
                out.append(grad)  # already in host memory, in the kernel's dtype: used in place, as without offload
                continue
            fragment = part.master_shards.pieces[index]
            whole = part.grad_view(fragment.bucket)
            out.append(self.bucket(part, fragment.bucket, whole)[fragment.shard_range.as_slice()])
        return out

    def read_ahead(self, tile: list[tuple]) -> Optional[ReadAhead]:
        """nvme: start reading the tile's gradients that backward wrote to the swap file (position in the tile ->
        buffer in the gradient's dtype, and the transfer to wait for), so that the reads overlap the step before
        (cpu_optimizer._step); None where there are none, or transfers are waited at once."""
        if self.nvme is None or not self.nvme.swapper.pool.overlap:
            return None
        transfer, reads = Transfer(), {}
        for position, (_, _, part, index) in enumerate(tile):
            if self.in_file(part, index):
                fragment = part.master_shards.pieces[index]
                reads[position] = self.nvme.start_read(part, fragment.bucket, fragment.shard_range.start,
                                                       fragment.shard_range.end, transfer)
                self.read_ahead_pieces += 1
        return ReadAhead(reads, transfer) if reads else None

    def for_tile(self, tile: list[tuple], copies: list,
                 ahead: Optional[ReadAhead] = None) -> list[torch.Tensor]:
        """Each tile entry's host gradient. What was not copied during backward is added to ``copies`` (host,
        device) for the caller to copy before the tile steps: the tile's own elements, one copy per run of
        contiguous pieces, so that they are still in cache when the tile steps. ``ahead``: the tile's reads from
        the swap file started by :meth:`read_ahead`."""
        if self.swapped:  # only the tile's gradients are in memory
            reads = {}
            if ahead is not None:
                ahead.transfer.wait()
                reads = ahead.reads
            out = []
            for position, (_, grad, part, index) in enumerate(tile):
                if self.in_file(part, index):  # written out during backward: read back (ahead, or now)
                    dtype = self.dtype(grad)
                    read = reads.get(position)
                    if read is not None and read.dtype == dtype:
                        out.append(read)
                        continue
                    host = torch.empty(grad.numel(), dtype=dtype)
                    if read is not None:
                        host.copy_(read)
                    else:
                        self.read_piece(part, index, 0, grad.numel(), host)
                    out.append(host)
                    continue
                if self.in_place(grad):
                    out.append(grad)
                    continue
                host = self.bucket(part, part.master_shards.pieces[index].bucket, grad)
                copies.append((host, grad))
                out.append(host)
            return out
        out = self.pieces(tile)
        for part, bucket, start, end, _ in tile_runs(tile):
            if self.stale(part, bucket):
                copies.append((self.buffers[(id(part), bucket)][start:end], part.grad_shards()[bucket][start:end]))
        return out

    def fetch(self, tile: list[tuple], queue: Optional[CopyQueue],
              ahead: Optional[ReadAhead] = None) -> tuple[list[torch.Tensor], Optional[Future]]:
        """The tile's host gradients, copied now (``queue`` None) or queued on the copy thread (its future)."""
        copies: list = []
        grads = self.for_tile(tile, copies, ahead)
        if queue is None:
            copy_all(copies, arrive=True)
            return grads, None
        return grads, queue.submit(copies, arrive=True)


class PieceSlices:
    """A piece's gradient read from the swap file slice by slice (``cuts``, in order): asking for one starts
    the read of the next (unless every transfer is waited at once), so it arrives while the caller steps."""

    def __init__(self, grads: HostGrads, part, index: int, cuts: list[tuple[int, int]]) -> None:
        self.grads, self.part, self.cuts = grads, part, cuts
        fragment = part.master_shards.pieces[index]
        self.bucket, self.offset = fragment.bucket, fragment.shard_range.start
        self.ahead = grads.nvme.swapper.pool.overlap
        self.pending: dict[int, tuple[torch.Tensor, Transfer]] = {}  # slice start -> (its buffer, its read)
        if self.ahead and cuts:
            self._start(0)

    def _start(self, position: int) -> None:
        start, end = self.cuts[position]
        transfer = Transfer()
        raw = self.grads.nvme.start_read(self.part, self.bucket, self.offset + start, self.offset + end, transfer)
        self.pending[start] = (raw, transfer)
        self.grads.read_ahead_pieces += 1

    def into(self, start: int, end: int, out: torch.Tensor) -> None:
        """Elements ``[start, end)`` of the piece's gradient into ``out`` (cast), and the next slice's read started."""
        read = self.pending.pop(start, None)
        if read is None:
            self.grads.nvme.read(self.part, self.bucket, self.offset + start, self.offset + end, out)
        else:
            read[1].wait()
            out.copy_(read[0])
        position = next((i for i, cut in enumerate(self.cuts) if cut[0] == start), None)
        if self.ahead and position is not None and position + 1 < len(self.cuts):
            self._start(position + 1)
