"""A master piece bigger than the NVMe tile, stepped slice by slice through the swap file (device 'nvme',
Adam/AdamW with torch's fused kernel).

The NVMe step reads, steps and writes out tiles of at most T elements (``NVME_TILE_NUMEL``, or ``sub_group_size``
if smaller), so that it holds about four tiles in host memory. A tile is whole pieces, though (one parameter's
fragment on this rank), and ``optimizer.step()`` steps a piece whole: an embedding at world size 1 was a tile of
its own, so the step held about 4 x 12 bytes x its size (a 128k x 4096 vocabulary: 25 GiB), and its first step
made both of Adam's moments whole in memory. Here such a piece is read, stepped and written out in slices of T
elements, the next slice read while this one steps and the last one written, as tiles are. torch's fused Adam
kernel (what ``Adam(fused=True).step()`` runs) is elementwise, so slices cut at multiples of 64 elements from the
piece's start step it bit for bit as a whole (chunked_step.py says why 64). A first step makes the state as Adam
does (a ``step`` scalar, zero moments), the moments' slices in memory only while they step. Other optimizers, and
pieces that fit a tile, step as before.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from zero_core.offload.aio import Transfer
from zero_core.offload.chunked_step import _cuts, piece_kernels, steps_fused_adam
from zero_core.offload.nvme_swap import _MASTER, NvmeSwapper
from zero_core.optim.kernels import only_params
from zero_core.optim.master_shards import unscale_and_clip

# (start, end) of a slice of the piece; the slice's fp32 host gradient, unscaled and clipped by the caller next
GradSlice = Callable[[int, int], torch.Tensor]
# (start, end, updated master slice): into the model's parameter shard
WriteBack = Callable[[int, int, torch.Tensor], None]


def sliced(optimizer: torch.optim.Optimizer, swapper: Optional[NvmeSwapper], tile: list, tile_numel: int) -> bool:
    """Whether ``tile`` (one piece bigger than ``tile_numel``) steps in slices: NVMe, and torch's fused Adam/AdamW
    is what ``optimizer.step()`` would run."""
    if swapper is None or len(tile) != 1:
        return False
    known = swapper.shape_of(tile[0].piece, _MASTER)  # (shape, dtype) once written to the file
    return known is not None and known[0].numel() > tile_numel and steps_fused_adam(optimizer)


def slices(numel: int, tile_numel: int) -> list[tuple[int, int]]:
    """[start, end) of each slice: ``tile_numel`` elements, rounded down to a multiple of 64 (the chunked step's
    cuts, of one piece)."""
    cuts = _cuts([0], [numel], tile_numel)
    return list(zip(cuts, cuts[1:]))


def write_in_slices(swapper: NvmeSwapper, piece: torch.Tensor, source: torch.Tensor, tile_numel: int) -> None:
    """``source``'s values as ``piece``'s (empty: swapped out) fp32 region of the file, cast a slice at a time."""
    flat = source.reshape(-1)
    if flat.numel() == 0:
        return  # an empty fragment: nothing to swap (as swap_out skips it)
    swapper.claim(piece, _MASTER, source.shape, torch.float32)
    for start, end in slices(flat.numel(), tile_numel):
        values = swapper.new_slice(torch.float32, end - start)
        values.copy_(flat[start:end])
        swapper.write_slices(piece, start, [(_MASTER, values)]).wait()


def step_in_slices(optimizer: torch.optim.Optimizer, swapper: NvmeSwapper, piece: torch.nn.Parameter,
                   grad_slice: GradSlice, write_back: WriteBack, inv_scale: float, clip: Optional[torch.Tensor],
                   tile_numel: int) -> int:
    """Step swapped-out ``piece`` slice by slice (see the module's doc); returns the number of slices."""
    kernel = piece_kernels(optimizer)[id(piece)]
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kernel.amsgrad else [])
    shape, dtype = swapper.shape_of(piece, _MASTER)
    state = optimizer.state[piece]
    first = "exp_avg" not in state
    if first:  # as Adam's first step makes it (fused: a float32 step on the piece's device), the moments on disk
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in keys:
            state[key] = torch.empty(0, dtype=dtype)  # swapped out: its region is written slice by slice below
            swapper.claim(piece, key, shape, dtype)
    step = state["step"]
    torch._foreach_add_([step], 1)  # once per piece, as Adam's step does

    def read(start: int, end: int) -> tuple[list[torch.Tensor], Transfer]:
        transfer = Transfer()
        master = swapper.read_slice(transfer, piece, _MASTER, start, end)
        moments = [swapper.new_slice(dtype, end - start).zero_() if first else
                   swapper.read_slice(transfer, piece, key, start, end) for key in keys]
        if not swapper.pool.overlap:
            transfer.wait()
        return [master] + moments, transfer

    cuts = slices(shape.numel(), tile_numel)
    writing: Optional[Transfer] = None
    upcoming = read(*cuts[0])
    try:
        with torch.no_grad():
            for index, (start, end) in enumerate(cuts):
                values, reading = upcoming
                reading.wait()
                if index + 1 < len(cuts):
                    upcoming = read(*cuts[index + 1])  # the next slice comes in while this one steps
                grad = grad_slice(start, end)
                unscale_and_clip([grad], inv_scale, clip)  # the same arithmetic as a tile's
                row = [values[0], grad] + values[1:]
                kernel.run([row], [step])
                write_back(start, end, values[0])
                if writing is not None:
                    writing.wait()  # one write in flight
                writing = swapper.write_slices(piece, start, list(zip([_MASTER] + keys, values)))
    finally:
        if writing is not None:
            writing.wait()
    with only_params(optimizer, []):  # the step's hooks and patched counters (LR schedulers), once for the tile
        optimizer.step()
    return len(cuts)
