"""ZeRO++'s blockwise wire formats (zero_core/comm/quantize.py), against the exact values."""

from __future__ import annotations

import pytest
import torch

from zero_core.comm.quantize import (BLOCK, dequantize, dequantize_segments, quantize, quantize_segments,
                                     segment_wire_bytes, wire_bytes)


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


# -- asymmetric 8-bit codes (qwZ's weights) ----------------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, 7, BLOCK, BLOCK + 3, 5 * BLOCK - 1])
def test_asymmetric_codes_are_within_half_a_step_of_min_to_max(numel):
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(numel)) * torch.tensor([[1e-3], [1.0], [50.0]])
    rows[1] += 3.0  # a row far from zero
    packed = quantize(rows, 8, asymmetric=True)
    back = dequantize(packed, 8, numel)
    block = min(BLOCK, numel + numel % 2) if numel < BLOCK else BLOCK
    # padding repeats the last element, so the last block's range is its own elements' range
    padded = torch.cat([rows, rows[:, -1:].expand(3, packed.scales.shape[1] * block - numel)], dim=1)
    blocks = padded.view(3, -1, block)
    assert packed.codes.dtype == torch.uint8 and packed.scales.dtype == packed.offsets.dtype == torch.float32
    assert torch.equal(packed.offsets, blocks.amin(2))
    assert torch.allclose(packed.scales, (blocks.amax(2) - blocks.amin(2)) / 255)
    per_element = packed.scales.repeat_interleave(block, dim=1)[:, :numel]
    assert ((back - rows).abs() <= per_element / 2 + 1e-6 * rows.abs().clamp(min=1)).all()
    assert packed.codes.numel() + packed.scales.numel() * 4 + packed.offsets.numel() * 4 == wire_bytes(
        3, numel, 8, asymmetric=True)


def test_asymmetric_codes_keep_constant_blocks_exact_and_reject_4_bits():
    rows = torch.ones(2, 2 * BLOCK)  # a fresh LayerNorm's gains
    rows[1, BLOCK:] = 0.0
    assert torch.equal(dequantize(quantize(rows, 8, asymmetric=True), 8, rows.shape[1]), rows)
    with pytest.raises(ValueError, match="asymmetric codes are 8-bit only"):
        quantize(rows, 4, asymmetric=True)


@pytest.mark.parametrize("low, high", [(1.236, 1.266), (0.93, 0.98), (1.0, 1.07)])
def test_gains_near_one_round_trip_to_their_16bit_values(low, high):
    """The qwZ loss gap's cause, isolated: 16-bit values clustered away from zero (LayerNorm gains). A symmetric
    int8 grid (steps of max/127, about one bf16 step near 1) rounds them off the bf16 grid, and re-rounding to
    bf16 moves many the same way: a systematic change of the layer's scale (the final norm's scales the logits).
    The asymmetric grid spans only min..max, far finer than bf16 there: every value comes back exactly."""
    values = (low + (high - low) * torch.rand(1, 64, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    symmetric = dequantize(quantize(values, 8), 8, 64).to(torch.bfloat16)
    asymmetric = dequantize(quantize(values, 8, asymmetric=True), 8, 64).to(torch.bfloat16)
    assert torch.equal(asymmetric, values)
    assert not torch.equal(symmetric, values)  # what the symmetric form did (benchmarks/nodes.py: +1.6% loss)


def test_scales_are_fp32_whatever_the_input_dtype():
    rows = torch.randn(2, 300, dtype=torch.bfloat16)
    for asymmetric in (False, True):
        packed = quantize(rows, 8, asymmetric=asymmetric)
        assert packed.scales.dtype == torch.float32
        back = dequantize(packed, 8, 300)
        assert back.dtype == torch.float32 and (back - rows.float()).abs().max() <= packed.scales.max() / 2 + 1e-6


# -- qgZ's int4 gradients: blocks per parameter unit, and the two-hop reduction's error ---------------------------
def test_small_gradients_next_to_large_ones_keep_their_own_scale():
    """The bias qgZ had: one block over a Linear's gradients and a LayerNorm's (100x smaller) rounds the
    LayerNorm's to zero, every step, in every rank's contribution. Blocks restarted at the unit boundary keep
    each within half a step of its own scale."""
    generator = torch.Generator().manual_seed(0)
    large = torch.randn(3, 200, generator=generator)
    small = 0.01 * torch.randn(3, 56, generator=generator)
    rows = torch.cat((large, small), dim=1)
    spanning = dequantize(quantize(rows, 4, 256), 4, 256, 256)
    assert torch.count_nonzero(spanning[:, 200:]) == 0  # the LayerNorm's gradients vanished
    back = dequantize_segments(quantize_segments(rows, (200, 56)), (200, 56))
    half_step = small.abs().amax(dim=1, keepdim=True) / 14
    assert ((back[:, 200:] - small).abs() <= half_step + 1e-7).all()
    assert ((back[:, :200] - large).abs() <= large.abs().amax(dim=1, keepdim=True) / 14 + 1e-6).all()


def test_segment_codes_are_exact_at_extremes_and_size_their_wire_format():
    rows = torch.tensor([[0.0, 0.0, 0.0, 1.0, -0.5, 0.25, 7.0]])  # a zero segment, one of 4 values (odd width)
    packed = quantize_segments(rows, (3, 4), block=4)
    back = dequantize_segments(packed, (3, 4), block=4)
    assert torch.equal(back[:, :3], torch.zeros(1, 3)) and back[0, 6] == 7.0 and back[0, 3] == 1.0
    assert packed.codes.shape == (1, 4) and packed.scales.shape == (1, 2)
    assert segment_wire_bytes(2, (3, 4), block=4) == 2 * (4 + 2 * 4)
    assert segment_wire_bytes(1, (1000, 24)) == 512 + 4 * 5  # blocks 256, 256, 256, 232 | 24: scales 4 + 1
    with pytest.raises(ValueError, match="segments sum to 6"):
        quantize_segments(rows, (3, 3))


def _two_hop_mean(sends: torch.Tensor, segments: tuple, nodes: int, per_node: int) -> torch.Tensor:
    """What zero_core/comm/paths.py's quantised reduce-scatter computes, in one process: ``sends[r]`` is rank
    r's pre-divided buffer (one slice per target rank); the first hop sends int4 rows to the node's peers and
    sums them in fp32, the second re-quantises those partial sums across nodes. Returns every rank's slice."""
    world, numel = nodes * per_node, sends.shape[1] // (nodes * per_node)

    def hop(rows: torch.Tensor, widths: tuple) -> torch.Tensor:  # rows from every member; sum what arrives
        return dequantize_segments(quantize_segments(rows, widths), widths).sum(0)

    by_local = sends.view(world, nodes, per_node, numel).transpose(1, 2)  # [sender, local index l, node j]
    partial = {(n, l): hop(by_local[n * per_node : (n + 1) * per_node, l].reshape(per_node, -1),
                           segments * nodes).view(nodes, numel)
               for n in range(nodes) for l in range(per_node)}
    return torch.stack([hop(torch.stack([partial[(n, l)][j] for n in range(nodes)]), segments)
                        for j in range(nodes) for l in range(per_node)])


def test_two_hop_int4_reduction_is_unbiased_against_the_exact_mean():
    """Many random gradient sets, units of very different scales (a LayerNorm's 100x smaller than a Linear's,
    heavy-tailed embedding rows): the error of the quantised mean averages to zero, does not shrink any unit
    (regression slope 1), and stays within the half steps of the two quantisations."""
    nodes, per_node, world = 2, 2, 4
    segments = (300, 64, 200)  # this rank's slice: a Linear's shard, a LayerNorm's, an embedding's
    scale = torch.cat((torch.full((300,), 1.0), torch.full((64,), 0.01), torch.full((200,), 0.1)))
    generator = torch.Generator().manual_seed(1)
    errors, exacts = [], []
    for _ in range(100):
        grads = torch.randn(world, world, sum(segments), generator=generator) * scale
        grads[..., 364:] *= torch.rand(world, world, 200, generator=generator) < 0.1  # sparse rows
        sends = (grads / world).reshape(world, -1)
        exact = sends.view(world, world, -1).sum(0)
        got = _two_hop_mean(sends, segments, nodes, per_node)
        errors.append(got - exact)
        exacts.append(exact)
        # each element: half a step of every sender's first-hop block, and half a step of the second hop's
        first = grads.abs().view(world, world, -1)  # bound by the largest magnitude in the unit, per sender
        assert (got - exact).abs().max() <= 2 * first.max() / world / 14 * (per_node + 1) + 1e-6
    error, exact = torch.stack(errors), torch.stack(exacts)
    start = 0
    for width in segments:
        e, x = error[..., start : start + width], exact[..., start : start + width]
        start += width
        rms = x.pow(2).mean().sqrt()
        assert abs(e.mean()) < 0.01 * rms  # no drift
        slope = (x * (x + e)).sum() / x.pow(2).sum()
        assert 0.97 < slope < 1.03  # no unit shrunk or inflated
        assert e.norm() / x.norm() < 0.35  # int4, twice


# -- what the engine's forward and backward see under qwZ (one process) -----------------------------------------
class _SeenWeight(torch.autograd.Function):
    """``x @ w.T`` that records the weight values its forward and its backward computed with."""

    @staticmethod
    def forward(ctx, x, weight, log):
        ctx.save_for_backward(x, weight)
        ctx.log = log
        log.append(("forward", weight.detach().clone()))
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.log.append(("backward", weight.detach().clone()))
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2), None


class _Recording(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(24, 40, generator=generator) * 0.05)
        self.norm = torch.nn.LayerNorm(24)
        with torch.no_grad():  # gains near 1, off zero: the values the symmetric grid got wrong
            self.norm.weight.copy_(1.2 + 0.05 * torch.rand(24, generator=generator))
        self.log: list = []

    def forward(self, x):
        return self.norm(_SeenWeight.apply(x, self.weight, self.log)).square().mean()


def _qwz_seen(rank: int, world_size: int) -> dict:
    import zero_core

    config = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0, "bf16": {"enabled": True},
              "zero_quantized_weights": True}
    model = _Recording()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = {"steps": []}
    for _ in range(2):
        exact = {name: p.detach().clone() for name, p in engine.runtime.iter_full_params()}
        model.log.clear()
        engine.backward(model(x))
        with torch.no_grad():
            again = model(x)  # a second forward before the step: quantised from the same shard again
        out["steps"].append({"exact": exact, "log": list(model.log)})
        engine.step()
    engine.close()
    return out


def test_qwz_forward_sees_dequantised_weights_and_backward_the_exact_ones():
    """The forward computes with int8-dequantised weights, quantised afresh from the 16-bit shard each time (no
    error accumulates); the backward re-gathers and computes with the exact 16-bit weights (DeepSpeed's qwZ)."""
    from distributed import run_distributed

    (result,) = run_distributed(_qwz_seen, 1, timeout=120)
    for step in result["steps"]:
        exact = step["exact"]["weight"]
        expected = dequantize(quantize(exact.reshape(1, -1), 8, asymmetric=True), 8, exact.numel())
        expected = expected.view_as(exact).to(exact.dtype)
        phases = [phase for phase, _ in step["log"]]
        assert phases == ["forward", "backward", "forward"], phases
        (_, first), (_, backward), (_, second) = step["log"]
        assert torch.equal(first, expected) and torch.equal(second, expected)
        assert not torch.equal(first, exact)  # the forward really was quantised
        assert torch.equal(backward, exact)


# -- zero_quantized_nontrainable_weights: frozen shards stored 8-bit (2 ranks) --------------------------------
FROZEN_STEPS = 5
FROZEN_LOSS_TOLERANCE = 0.01  # relative, per step: only the frozen weights' storage differs (by <= half a step)


def _frozen_model():
    """The tied embedding and the first block frozen (a fine-tuning run): the units stored quantised."""
    from models import build_model

    model = build_model("transformer")
    model.tok.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    return model


def _frozen_storage(rank: int, world_size: int, directory: str) -> dict:
    import zero_core
    from models import make_batch
    from reference import make_optimizer
    from stage3_support import train_engine
    from zero_core.tools.estimator import estimate_stage, model_info

    data = lambda r, step, micro: make_batch("transformer", r, step, micro)  # noqa: E731
    initial = {k: v.clone() for k, v in _frozen_model().state_dict().items()}
    out = {}
    for name, extra in {"plain": {}, "stored": {"zero_quantized_nontrainable_weights": True}}.items():
        config = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0, **extra}
        result, engine = train_engine(_frozen_model, data, config, FROZEN_STEPS)
        frozen = {k: v for k, v in engine.full_state_dict(rank0_only=False).items()
                  if k.startswith(("tok.", "blocks.0."))}
        units = [u for u in engine.runtime.units if not u.trainable]
        estimate = estimate_stage(model_info(_frozen_model()), {**config, "reduce_bucket_size": 500_000_000},
                                  world_size, precision="fp32")
        out[name] = {"losses": result.losses, "params": result.params, "memory": engine.memory_stats(),
                     "estimate": estimate.params, "frozen": frozen,
                     "stored": [u.quantized is not None and u.shard.numel() == 0 for u in units]}
        if name == "stored":  # a checkpoint round trip: loading writes the frozen values into 8-bit shards again
            engine.save_checkpoint(f"{directory}/stored")
            model = _frozen_model()
            other = zero_core.setup(model, make_optimizer(model), config)
            other.load_checkpoint(f"{directory}/stored")
            loaded = other.full_state_dict(rank0_only=False)
            out["reloaded"] = max((loaded[k] - v).abs().max().item() for k, v in frozen.items())
            other.close()
        engine.close()
    out["initial"] = initial
    return out


def test_frozen_weights_stored_quantised_train_like_the_16bit_run_in_less_memory(tmp_path):
    """Frozen, gathered units keep int8 codes with per-block scales and minima instead of their shard; their
    gathers dequantise them. Losses stay within 1% of the unquantised run, the frozen weights within half a
    step of their values, and parameter memory (memory_stats and the estimator alike) drops by the shards'
    fp32 bytes less the codes. A checkpoint of it loads back to the same frozen values."""
    from distributed import run_distributed

    from stage3_support import expected_units

    model = _frozen_model()
    names = {id(p): n for n, p in model.named_parameters()}
    unit_of = {names[id(p)]: [names[id(q)] for q in u["params"]] for u in expected_units(model, 2) for p in u["params"]}
    for rank_result in run_distributed(_frozen_storage, 2, str(tmp_path), timeout=200):
        plain, stored = rank_result["plain"], rank_result["stored"]
        assert stored["stored"] and all(stored["stored"]) and not any(plain["stored"])
        gaps = [abs(a - b) / abs(b) for a, b in zip(stored["losses"], plain["losses"])]
        assert max(gaps) < FROZEN_LOSS_TOLERANCE, gaps
        initial = rank_result["initial"]
        for key, value in stored["frozen"].items():
            # a quantisation block holds values of one unit (a transformer block's parameters are one unit): its
            # range is within the range of that unit's frozen values
            unit = [initial[k] for k in unit_of[key]]
            half_step = (max(v.max() for v in unit) - min(v.min() for v in unit)) / 510
            assert (value - initial[key]).abs().max() <= half_step + 1e-6, key
            assert torch.equal(plain["frozen"][key], initial[key])
        saved = plain["memory"]["params"] - stored["memory"]["params"]
        assert saved > 0 and saved == plain["estimate"] - stored["estimate"], (saved, plain["estimate"],
                                                                                stored["estimate"])
        assert stored["memory"]["params"] == stored["estimate"], (stored["memory"], stored["estimate"])
        assert rank_result["reloaded"] <= 1e-6  # re-quantising dequantised values gives them back
