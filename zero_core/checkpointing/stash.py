"""Where a checkpoint's inputs wait between its forward and its recomputation: a ``Stash``.

torch.utils.checkpoint keeps a checkpointed function's inputs as they are (on the accelerator, wherever the
allocator put them). The ``activation_checkpointing`` block keeps them differently, and a ``Stash`` does each:
- ``partition_activations``: only this rank's 1/N of each input (flattened, padded to N equal parts), gathered
  back over the model-parallel group before recomputation (ZeRO-R's Pa);
- ``cpu_checkpointing``: in host memory, pinned with CUDA, copied out on the copy stream, and copied back on it
  ahead of the recomputation: when one checkpoint's recomputation starts, the next one's copy starts (Pa+cpu);
- ``contiguous_memory_optimization``: in a slot of one buffer allocated once per device (``ContiguousBuffer``),
  so the kept inputs do not fragment the allocator's memory (ZeRO-R's constant buffers and defragmentation).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from zero_core.checkpointing.settings import Settings

ALIGN = 64  # bytes: every piece in a slot starts aligned, so views of any dtype are valid


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ContiguousBuffer:
    """``number_checkpoints`` equal slots in one byte buffer, sized by the first checkpoint that takes one; slots are
    taken in forward order and all free again once every stash in them was restored (after the backward)."""

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device, self.pinned = device, pinned
        self.data: Optional[torch.Tensor] = None
        self.slot_bytes = self.next = self.live = 0

    def take(self, nbytes: int, settings: Settings) -> torch.Tensor:
        number = settings.number_checkpoints
        if self.data is None:
            self.slot_bytes = _aligned(nbytes)
            self.data = torch.empty(self.slot_bytes * number, dtype=torch.uint8, device=self.device,
                                    pin_memory=self.pinned)
            settings.stats.buffer_bytes += self.data.numel()
        if nbytes > self.slot_bytes:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: a checkpoint's inputs take "
                             f"{nbytes} bytes, more than the {self.slot_bytes} of a slot (sized by the first "
                             "checkpoint); checkpoint functions whose inputs have one size, or turn it off")
        if self.next >= number:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: more than number_checkpoints="
                             f"{number} checkpoints kept at once; raise number_checkpoints, or call "
                             "zero_core.checkpointing.reset() after forward passes that no backward follows")
        start = self.next * self.slot_bytes
        self.next += 1
        self.live += 1
        settings.stats.slots_taken += 1
        return self.data[start:start + nbytes]

    def give_back(self) -> None:
        self.live -= 1
        if self.live <= 0:
            self.reset()

    def reset(self) -> None:
        self.next = self.live = 0


def _my_part(t: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/N of ``t`` flattened (zero-padded to N equal parts)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = -(-t.numel() // world)
    flat = t.detach().reshape(-1)
    if per * world != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(per * world - flat.numel())])
    return flat[rank * per:(rank + 1) * per]


class Stash:
    """One checkpoint's floating tensor inputs, kept as ``settings`` says until ``restore``."""

    def __init__(self, settings: Settings, tensors: list[torch.Tensor]) -> None:
        self.settings = settings
        self.meta = [(t.shape, t.dtype, t.requires_grad) for t in tensors]
        self.device = tensors[0].device
        group = settings.partition_group
        pieces = [_my_part(t, group) if group is not None else t.detach().reshape(-1) for t in tensors]
        self.on_host = settings.cpu and self.device.type != "cpu"
        where = torch.device("cpu") if settings.cpu else self.device
        pinned = settings.cpu and self.device.type == "cuda"
        self.buffer: Optional[ContiguousBuffer] = None
        self._give_back = None
        if settings.contiguous:
            self.buffer = settings.buffers.setdefault((where, pinned), ContiguousBuffer(where, pinned))
            slot = self.buffer.take(sum(_aligned(p.numel() * p.element_size()) for p in pieces), settings)
            # The slot comes back once: at its restore, or when a forward's graph is dropped without a backward.
            self._give_back = weakref.finalize(self, self.buffer.give_back)
            self.kept, offset = [], 0
            for p in pieces:
                nbytes = p.numel() * p.element_size()
                self.kept.append(slot[offset:offset + nbytes].view(p.dtype))
                offset += _aligned(nbytes)
        else:
            self.kept = [torch.empty(p.shape, dtype=p.dtype, device=where, pin_memory=pinned) for p in pieces]
        self._copy_in(pieces)
        self.fetched: Optional[list[torch.Tensor]] = None
        self.event = None
        stats = settings.stats
        stats.stashed += len(tensors)
        stats.stashed_bytes += sum(k.numel() * k.element_size() for k in self.kept)
        stats.host_bytes += sum(k.numel() * k.element_size() for k in self.kept if k.device.type == "cpu")
        settings.pending.append(weakref.ref(self))  # weakly: a graph dropped without backward frees its stashes

    def _copy_in(self, pieces: list[torch.Tensor]) -> None:
        if not self.on_host or self.device.type != "cuda":
            for dst, src in zip(self.kept, pieces):
                dst.copy_(src)
            return
        stream = self.settings.copy_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the inputs are computed by now
        with torch.cuda.stream(stream):
            for dst, src in zip(self.kept, pieces):
                dst.copy_(src, non_blocking=True)
        for src in pieces:
            src.record_stream(stream)  # its memory is not reused before the copy is done

    def prefetch(self) -> bool:
        """Start copying a host stash back to its device on the copy stream (CUDA; elsewhere nothing to do);
        whether a copy started."""
        if not self.on_host or self.fetched is not None or self.device.type != "cuda":
            return False
        stream = self.settings.copy_stream(self.device)
        with torch.cuda.stream(stream):
            self.fetched = [k.to(self.device, non_blocking=True) for k in self.kept]
            self.event = torch.cuda.Event()
            self.event.record(stream)
        return True

    def restore(self) -> list[torch.Tensor]:
        """The inputs again, for the recomputation; starts bringing back the stash recomputed next."""
        pending = self.settings.pending
        pending[:] = [ref for ref in pending if ref() is not None and ref() is not self]
        following = pending[-1]() if pending else None  # backward runs the checkpoints in reverse
        self.prefetch()  # this stash's own copy first (when nothing brought it back ahead): it is waited for now
        if following is not None and following.prefetch():
            self.settings.stats.prefetched += 1
        flat = self._local()
        group = self.settings.partition_group
        out = []
        for piece, (shape, dtype, requires_grad) in zip(flat, self.meta):
            if group is not None:
                parts = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, piece.contiguous(), group=group)
                piece = torch.cat(parts)[:shape.numel()]
            out.append(piece.view(dtype).view(shape).detach().requires_grad_(requires_grad))
        self.settings.stats.restored += len(out)
        if self._give_back is not None and not self.on_host:
            self._give_back()  # device slots are used in place; their memory is free after the backward
        return out

    def _local(self) -> list[torch.Tensor]:
        if not self.on_host:
            return self.kept
        if self.device.type != "cuda":  # another accelerator: a plain synchronous copy back
            fetched = [k.to(self.device) for k in self.kept]
        else:
            self.prefetch()
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            for t in self.fetched:
                t.record_stream(current)  # allocated on the copy stream, used on this one
            fetched, self.fetched = self.fetched, None
        if self._give_back is not None:
            self._give_back()  # copied back: the host slot may be taken again
        return fetched
