"""Blockwise quantisation for ZeRO++'s wire formats, in plain torch ops (no compiled kernel).

Each row of a 2-D tensor is cut into blocks of ``block`` elements (fewer for a shorter row; the last block is
padded); a block keeps one fp32 scale and one integer code per element:
- int4, symmetric: scale = the block's largest magnitude / 7, codes in [-7, 7], two per byte (low nibble first);
  padding is zeros. qgZ's gradients use the same codes through :func:`quantize_segments`, whose blocks restart
  at every parameter unit of a reduction bucket (below).
- 8 bits, asymmetric (qwZ, weights): the block's minimum is kept too (``offsets``, fp32), scale = (max - min) /
  255 and codes in [0, 255] (uint8); padding repeats the row's last element, so it never widens a range.
  Asymmetric because weights are not all centred on zero: a LayerNorm gain sits near 1 within a few percent,
  where a symmetric grid (steps of max/127) lands between 16-bit values and rounds a whole block the same way,
  a systematic change of that layer's scale (+1.6% loss after 200 steps in benchmarks/nodes.py, from the final
  norm alone); its min..max grid resolves such a block finely, and costs a centred one nothing.
  ``asymmetric=False`` gives the symmetric int8 form (codes in [-127, 127]).
Dequantising gives values within half a step (scale / 2) of the originals; constant blocks (all zeros, a fresh
LayerNorm's ones) stay exact. With a ``generator``, codes are rounded stochastically instead (within one step,
unbiased: the expected value is the original). qgZ rounds to nearest: with Adam, stochastic rounding's extra
variance cost more loss than its bias removal gained (+6% against +1.6% after 200 steps in benchmarks/nodes.py,
single runs measured while qgZ's blocks still spanned parameter units); with per-unit blocks round-to-nearest
ends +0.46% above stage 3 over 3 seeds (docs/multinode.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence

import torch

BLOCK = 256  # elements per scale: DeepSpeed's ZeRO++ uses group sizes of this order
GRAD_BLOCK = BLOCK  # int4 gradients, blocks restarted at every segment (parameter unit): segment_blocks
_LEVELS = {8: 127, 4: 7}


class Quantized(NamedTuple):
    codes: torch.Tensor  # (rows, bytes per row): int8 (symmetric 8 bits), uint8 (asymmetric 8 bits, 4-bit pairs)
    scales: torch.Tensor  # (rows, blocks per row), fp32
    offsets: Optional[torch.Tensor] = None  # (rows, blocks per row), fp32: each block's minimum (asymmetric)


def block_size(numel: int, block: int = BLOCK) -> int:
    """A row shorter than a block is one block of its own length (even, for 4-bit pairs): no padding sent."""
    return block if numel >= block else max(2, numel + numel % 2)


def blocks_per_row(numel: int, block: int = BLOCK) -> int:
    return max(1, -(-numel // block_size(numel, block)))


def quantize(rows: torch.Tensor, bits: int, block: int = BLOCK,
             generator: "torch.Generator | None" = None, asymmetric: bool = False) -> Quantized:
    """Quantise every row of ``rows`` (2-D, floating) to ``bits`` (8 or 4) in blocks of ``block`` elements;
    rounding to nearest, or stochastically with ``generator``; ``asymmetric`` (8 bits only): min..max codes."""
    if bits not in _LEVELS:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits}")
    if asymmetric and bits != 8:
        raise ValueError(f"quantize: asymmetric codes are 8-bit only, got bits={bits}")
    count, numel = rows.shape
    block = block_size(numel, block)
    nblocks = blocks_per_row(numel, block)
    padded = torch.zeros(count, nblocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :numel] = rows
    if asymmetric and numel < nblocks * block:
        padded[:, numel:] = padded[:, numel - 1 : numel]  # the last block's own value: its range stays
    padded = padded.view(count, nblocks, block)
    offsets = None
    if asymmetric:
        offsets = padded.amin(dim=2)
        scales = (padded.amax(dim=2) - offsets) / 255
        padded = padded - offsets.unsqueeze(2)
        low, high = 0, 255
    else:
        high = _LEVELS[bits]
        low = -high
        scales = padded.abs().amax(dim=2) / high
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = padded / safe.unsqueeze(2)
    if generator is None:
        scaled = torch.round(scaled)
    else:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device)
        scaled = torch.floor(scaled + noise)
    codes = scaled.clamp_(low, high).to(torch.uint8 if asymmetric else torch.int8).view(count, -1)
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(count, -1, 2)
        codes = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    return Quantized(codes.contiguous(), scales.contiguous(), None if offsets is None else offsets.contiguous())


def dequantize(packed: Quantized, bits: int, numel: int, block: int = BLOCK) -> torch.Tensor:
    """fp32 rows of ``numel`` elements back from :func:`quantize`'s output."""
    codes, scales, offsets = packed
    count, block = codes.shape[0], block_size(numel, block)
    if bits == 4:
        low = (codes & 0x0F).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack((low, high), dim=2).view(count, -1)
    values = codes.to(torch.float32).view(count, -1, block) * scales.unsqueeze(2)
    if offsets is not None:
        values += offsets.unsqueeze(2)
    return values.view(count, -1)[:, :numel]


def wire_bytes(rows: int, numel: int, bits: int, block: int = BLOCK, asymmetric: bool = False) -> int:
    """Bytes ``rows`` quantised rows of ``numel`` elements take on the wire (codes, scales and offsets)."""
    nblocks = blocks_per_row(numel, block)
    per_block = 8 if asymmetric else 4
    return rows * (nblocks * block_size(numel, block) * bits // 8 + nblocks * per_block)


# -- int4 gradients in segments (qgZ) ---------------------------------------------------------------------------
# A reduction bucket's row holds the shards of several parameter units side by side. A block spanning two of them
# takes its scale from the larger gradients, and the other unit's elements below half a step round to zero: a
# LayerNorm's gradients next to a Linear's vanished from the reduction entirely (tests/core/test_quantize.py,
# docs/multinode.md). DeepSpeed's qgZ quantises each tensor on its own (and sends 1-D ones unquantised); here the
# blocks restart at every segment (unit) boundary, so each unit's gradients get scales of their own.


@lru_cache(maxsize=256)
def segment_blocks(segments: tuple, block: int = GRAD_BLOCK) -> tuple[torch.Tensor, int]:
    """The block index of every element of a row cut into ``segments`` (widths), and the number of blocks:
    blocks of ``block`` elements restart at each segment, the last of a segment may be shorter."""
    ids, first = [], 0
    for width in segments:
        ids.append(first + torch.arange(width) // block)
        first += -(-width // block)
    return torch.cat(ids), first


def quantize_segments(rows: torch.Tensor, segments: Sequence[int], block: int = GRAD_BLOCK) -> Quantized:
    """Symmetric int4 codes of every row of ``rows`` (2-D), in blocks that never cross a segment boundary:
    scale = the block's largest magnitude / 7, codes in [-7, 7] rounded to nearest, two per byte."""
    count, width = rows.shape
    if sum(segments) != width:
        raise ValueError(f"quantize_segments: segments sum to {sum(segments)}, rows have {width} columns")
    ids, nblocks = segment_blocks(tuple(segments), block)
    ids = ids.to(rows.device)
    values = rows.to(torch.float32)
    amax = torch.zeros(count, nblocks, dtype=torch.float32, device=rows.device)
    amax.scatter_reduce_(1, ids.expand(count, -1), values.abs(), "amax")
    scales = amax / 7
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(values / safe.index_select(1, ids)).clamp_(-7, 7).to(torch.int8)
    if width % 2:
        codes = torch.cat((codes, torch.zeros(count, 1, dtype=torch.int8, device=rows.device)), dim=1)
    nibbles = (codes + 8).to(torch.uint8).view(count, -1, 2)
    return Quantized((nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).contiguous(), scales)


def dequantize_segments(packed: Quantized, segments: Sequence[int], block: int = GRAD_BLOCK) -> torch.Tensor:
    """fp32 rows back from :func:`quantize_segments`' output."""
    codes, scales = packed.codes, packed.scales
    ids, _ = segment_blocks(tuple(segments), block)
    ids, width = ids.to(codes.device), ids.numel()
    values = torch.stack(((codes & 0x0F).to(torch.int8) - 8, (codes >> 4).to(torch.int8) - 8), dim=2)
    return values.view(codes.shape[0], -1)[:, :width].to(torch.float32) * scales.index_select(1, ids)


def segment_wire_bytes(rows: int, segments: Sequence[int], block: int = GRAD_BLOCK) -> int:
    """Bytes of ``rows`` rows in :func:`quantize_segments`' format: packed codes and an fp32 scale per block."""
    return rows * (-(-sum(segments) // 2) + 4 * segment_blocks(tuple(segments), block)[1])
