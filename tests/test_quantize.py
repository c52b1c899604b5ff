"""ZeRO++'s blockwise wire formats (zero_core/comm/quantize.py), against the exact values."""

from __future__ import annotations

import pytest
import torch

from zero_core.comm.quantize import BLOCK, dequantize, quantize, wire_bytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, BLOCK, BLOCK + 3, 5 * BLOCK - 1])
def test_dequantized_values_are_within_half_a_step(bits, numel):
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(numel)) * torch.tensor([[1e-3], [1.0], [50.0]])
    packed = quantize(rows, bits)
    back = dequantize(packed, bits, numel)
    assert back.shape == rows.shape
    # each element's own block scale bounds its error (half a step); scales follow each row's magnitude
    block = min(BLOCK, numel + numel % 2) if numel < BLOCK else BLOCK
    padded = torch.nn.functional.pad(rows, (0, packed.scales.shape[1] * block - numel))
    per_element = packed.scales.repeat_interleave(block, dim=1)[:, :numel]
    assert ((back - rows).abs() <= per_element / 2 + 1e-7).all()
    assert torch.equal(packed.scales, padded.view(3, -1, block).abs().amax(2) / (127 if bits == 8 else 7))
    assert packed.codes.numel() + packed.scales.numel() * 4 == wire_bytes(3, numel, bits)


def test_wire_size_is_a_quarter_and_an_eighth_of_fp32_for_large_rows():
    numel = 64 * BLOCK
    assert wire_bytes(1, numel, 8) / (4 * numel) < 0.26
    assert wire_bytes(1, numel, 4) / (4 * numel) < 0.14


def test_zero_blocks_and_extremes_are_exact():
    rows = torch.zeros(2, 2 * BLOCK)
    rows[1, :BLOCK] = torch.linspace(-3.0, 3.0, BLOCK)
    for bits in (8, 4):
        back = dequantize(quantize(rows, bits), bits, rows.shape[1])
        assert torch.equal(back[0], rows[0]) and torch.equal(back[1, BLOCK:], rows[1, BLOCK:])
        assert back[1, 0].item() == pytest.approx(-3.0) and back[1, BLOCK - 1].item() == pytest.approx(3.0)


def test_bad_bit_width_names_the_choices():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(torch.ones(1, 4), 2)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    rows = torch.randn(2, 1000, generator=torch.Generator().manual_seed(1)) * torch.tensor([[1e-3], [1.0]])
    generator = torch.Generator().manual_seed(0)
    draws = 400
    total = torch.zeros_like(rows)
    for _ in range(draws):
        packed = quantize(rows, 4, 64, generator)
        back = dequantize(packed, 4, rows.shape[1], 64)
        steps = packed.scales.repeat_interleave(64, dim=1)[:, : rows.shape[1]]
        assert ((back - rows).abs() <= steps + 1e-7).all()
        total += back
    # the mean of the draws converges to the values: a draw's error has a standard deviation of at most half
    # a step, so the mean's stays within 5 standard errors
    assert ((total / draws - rows).abs() <= 5 * 0.5 * steps / draws ** 0.5 + 1e-7).all()
