"""One part's fp32 master pieces in host memory (``offload_optimizer``), replacing its ``MasterShards``.

The pieces are what the optimizer steps, one per parameter fragment, as without offload (master_shards.py), so
parameters that got no gradient keep ``grad=None`` and are not stepped. Where they live:
- ``device: cpu``: each bucket has one host fp32 tensor (pinned with ``pin_memory`` when CUDA exists) and the
  pieces are views of it, so the write-back after a step is one copy per bucket. A bucket whose parameter shard
  is itself fp32 in (unpinned) host memory, as in fp32 training on a CPU-only machine, is its own master, as
  without offload: copying it would only cost time and memory (except with the delayed update, delayed_update.py,
  whose masters change while the next forward reads the shards).
- ``device: nvme``: each piece is a tensor of its own, because the swap (nvme_swap.py) frees and re-reads tensors
  one by one; a piece that is swapped out is empty, and the step wrote it back before swapping it out. Its fp32
  values are written to the swap file slice by slice as it is made (``store``), so that setup never holds a whole
  piece (an embedding at world size 1) in fp32.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from zero_core.optim.master_shards import MasterShards, take_changed_values
from zero_core.offload.placement import host_copy


def _host_fp32(tensor: torch.Tensor, pin: bool) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and (tensor.is_pinned() or not pin)


class HostMasterShards(MasterShards):
    """fp32 master pieces of one part on the host: bucket views (cpu) or separate tensors (nvme)."""

    def __init__(self, source: MasterShards, pin: bool, separate: bool,
                 store: Optional[Callable[[torch.Tensor], nn.Parameter]] = None, own_copy: bool = False) -> None:
        """``store`` (nvme, with ``separate``): makes the master piece of each source piece, written to the swap
        file (and swapped out), so that no more than a slice of the part is in memory at a time. ``own_copy``
        (cpu): never the shard itself (the delayed update changes masters while the shards are read)."""
        self.pieces = list(source.pieces)
        self.separate = separate
        if separate:
            self.buckets = []
            self.params = []
            if store is None:
                raise ValueError("separate master pieces are made by the swap file's store (device 'nvme')")
            for p in source.params:
                self.params.append(store(p.detach()))
        else:
            self.buckets = [b if _host_fp32(b, pin) and not own_copy else host_copy(b, torch.float32, pin)
                            for b in source.buckets]
            self.params = [nn.Parameter(self.buckets[f.bucket][f.shard_range.as_slice()]) for f in self.pieces]

    def attach_grads(self, grad_shards, used, inv_scale, clip_coef) -> None:
        raise RuntimeError("offloaded masters get their gradients tile by tile (zero_core/offload); a bug if reached")

    def piece_shard(self, param_shards: Sequence[torch.Tensor], index: int) -> torch.Tensor:
        """The slice of the model's parameter shards that piece ``index`` writes back into."""
        piece = self.pieces[index]
        return param_shards[piece.bucket][piece.shard_range.as_slice()]

    def holds_values(self) -> bool:
        return not self.separate or any(master.numel() for master in self.params)

    # Set by the offloaded step when it wrote every stepped piece back itself, tile by tile (cpu_optimizer.py):
    # the write-back that follows the step is then skipped once (the pieces it did not step are unchanged).
    written_back = False

    def write_back(self, param_shards: Sequence[torch.Tensor]) -> None:
        if self.written_back:
            self.written_back = False
            return
        if not self.separate:
            super().write_back(param_shards)
            return
        for index, master in enumerate(self.params):
            if master.numel():  # swapped out: the step wrote it back before the swap
                self.piece_shard(param_shards, index).copy_(master.detach())

    def read_from(self, param_shards: Sequence[torch.Tensor],
                  before: Optional[Sequence[torch.Tensor]] = None) -> None:
        if not self.separate:
            super().read_from(param_shards, before)
            return
        for index, master in enumerate(self.params):  # the caller holds the pieces resident
            take_changed_values(master.detach(), self.piece_shard(param_shards, index),
                                None if before is None else self.piece_shard(before, index))


def write_back_pieces(tile: list[tuple]) -> None:
    """Copy a tile's updated pieces into the model's parameter shards (read in and out again when those are
    offloaded to NVMe themselves)."""
    by_part: dict = {}
    for piece, _, part, index in tile:
        by_part.setdefault(part, []).append((index, piece))
    for part, entries in by_part.items():
        with part.shard_in_memory():
            shards = part.param_shards()
            for index, piece in entries:
                part.master_shards.piece_shard(shards, index).copy_(piece.detach())
