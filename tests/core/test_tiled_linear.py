"""zero_core.TiledLinear: DeepSpeed's tiled linear layer. It computes what ``nn.Linear`` computes with the same
weights (split inputs and outputs, bias in each row's last tile, input_is_already_split, combine_out_splits=False),
trains at stages 1-3 on 2 ranks to the weights DDP gives the ``nn.Linear`` model, and at stage 3 each tile is a
unit of its own (inside a block too) and the engine's gathered-element peak over a 4x4-tiled layer's forward and
backward is one tile plus the next one prefetched, where the untiled layer gathers the whole weight.
TiledLinearReturnBias (Megatron-style layers returning (output, bias) unadded) computes what its untiled layer
does and trains at stage 3 to DDP's weights with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_core
from distributed import run_distributed
from models import mlp_batch
from reference import train_ddp
from stage3_support import max_abs_diff, train_engine

HIDDEN, WIDE = 24, 18
STEPS = 3
TOL = 2e-5
# (in_splits, out_splits, bias, input_is_already_split, combine_out_splits)
VARIANTS = [(3, 2, True, False, True), (2, 3, False, False, True), (3, 2, True, True, False), (1, 1, True, False, True)]


def tiled_weights(layer: zero_core.TiledLinear, prefix: str, params: dict) -> dict:
    """The whole weight and bias a TiledLinear's tiles make up, from a name -> tensor dict of its parameters."""
    rows = [torch.cat([params[f"{prefix}.linears.{r}.{c}.weight"] for c in range(layer.in_splits)], dim=1)
            for r in range(layer.out_splits)]
    out = {f"{prefix}.weight": torch.cat(rows, dim=0)}
    if layer.use_bias:
        out[f"{prefix}.bias"] = torch.cat([params[f"{prefix}.linears.{r}.{layer.in_splits - 1}.bias"]
                                           for r in range(layer.out_splits)])
    return out


class TiledMLP(nn.Module):
    """13 -> 24 -> (tiled or plain) 18 -> 7; the plain and tiled models start from the same weights."""

    def __init__(self, variant=VARIANTS[0], tiled: bool = True, seed: int = 0):
        super().__init__()
        in_splits, out_splits, bias, already_split, combine = variant
        self.already_split, self.combine = already_split, combine
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(13, HIDDEN)
            plain = nn.Linear(HIDDEN, WIDE, bias=bias)
            self.out = nn.Linear(WIDE, 7)
            self.mid = zero_core.TiledLinear(HIDDEN, WIDE, bias, in_splits, out_splits, already_split, combine,
                                             init_linear=plain) if tiled else plain
        self.tiled = tiled

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.tiled and self.already_split and self.mid.in_splits > 1:
            parts = self.mid.in_parts
            h = [h[..., parts[i]:parts[i + 1]] for i in range(self.mid.in_splits)]
        h = self.mid(h)
        if self.tiled and not self.combine:
            h = torch.cat(h, dim=-1)
        return F.mse_loss(self.out(torch.tanh(h)), y)


class TiledBlock(nn.Module):
    """A residual block whose MLP's first layer is tiled: the block is one unit, its tiles units of their own."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = zero_core.TiledLinear(HIDDEN, 32, in_splits=2, out_splits=2)
        self.down = nn.Linear(32, HIDDEN)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class BlockModel(nn.Module):
    def __init__(self, tiled: bool = True):
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(13, HIDDEN)
        self.blocks = nn.ModuleList([TiledBlock() for _ in range(2)])
        self.out = nn.Linear(HIDDEN, 7)
        if not tiled:  # the same weights in one nn.Linear per block
            for block in self.blocks:
                whole = tiled_weights(block.up, "up", {f"up.{k}": v for k, v in block.up.named_parameters()})
                block.up = nn.Linear(HIDDEN, 32)
                block.up.weight.data.copy_(whole["up.weight"])
                block.up.bias.data.copy_(whole["up.bias"])

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.out(h), y)


class PeakModel(nn.Module):
    """One 64x64 layer, tiled 4x4 or not; its input requires grad (as inside a network) or not (a first layer)."""

    def __init__(self, tiled: bool, input_grad: bool = True):
        super().__init__()
        torch.manual_seed(5)
        self.layer = zero_core.TiledLinear(64, 64, in_splits=4, out_splits=4) if tiled else nn.Linear(64, 64)
        self.input_grad = input_grad

    def forward(self, x, y):
        return F.mse_loss(self.layer(x.detach().requires_grad_(self.input_grad)).sum(-1, keepdim=True), y)


class LinearReturnBias(nn.Linear):
    """Megatron's skip_bias_add: the output without the bias, and the bias, for the caller to add."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class ReturnBiasMLP(nn.Module):
    """13 -> 24 -> (tiled 3x2 or plain) LinearReturnBias 18 -> 7; the caller adds the returned bias."""

    def __init__(self, tiled: bool = True):
        super().__init__()
        torch.manual_seed(7)
        self.inp = nn.Linear(13, HIDDEN)
        plain = LinearReturnBias(HIDDEN, WIDE)
        self.out = nn.Linear(WIDE, 7)
        self.mid = zero_core.TiledLinearReturnBias(HIDDEN, WIDE, in_splits=3, out_splits=2,
                                                   linear_cls=LinearReturnBias, init_linear=plain) if tiled else plain

    def forward(self, x, y):
        h, bias = self.mid(torch.tanh(self.inp(x)))
        return F.mse_loss(self.out(torch.tanh(h + bias)), y)


def peak_batch(rank, step, micro):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 64, generator=g), torch.randn(8, 1, generator=g)


def _config(stage: int) -> dict:
    return {"stage": stage, "stage3_param_persistence_threshold": 0}


def _train_section(rank):
    """Each variant at stages 1-3 against DDP on the nn.Linear model: max abs weight difference per run."""
    diffs = {}
    for variant in VARIANTS:
        reference = train_ddp(lambda: TiledMLP(variant, tiled=False), mlp_batch, STEPS).params
        for stage in (1, 2, 3):
            result, engine = train_engine(lambda: TiledMLP(variant), mlp_batch, _config(stage), STEPS)
            whole = {k: v for k, v in result.params.items() if not k.startswith("mid.")}
            whole.update(tiled_weights(engine.module.mid, "mid", result.params))
            diffs[f"{variant} stage {stage}"] = max_abs_diff(whole, reference)
            engine.close()
    return diffs


def _block_section(rank):
    """Tiles inside a block: units of their own (the block's other parameters one unit), and training to DDP."""
    reference = train_ddp(lambda: BlockModel(tiled=False), mlp_batch, STEPS).params
    result, engine = train_engine(BlockModel, mlp_batch, _config(3), STEPS)
    owners = sorted({u.module_name for u in engine.runtime.units})
    whole = {k: v for k, v in result.params.items() if ".up." not in k}
    for i, block in enumerate(engine.module.blocks):
        whole.update(tiled_weights(block.up, f"blocks.{i}.up", result.params))
    engine.close()
    return {"owners": owners, "diff": max_abs_diff(whole, reference)}


def _return_bias_section(rank):
    """TiledLinearReturnBias at stage 3 against DDP with the untiled LinearReturnBias."""
    reference = train_ddp(lambda: ReturnBiasMLP(tiled=False), mlp_batch, STEPS).params
    result, engine = train_engine(ReturnBiasMLP, mlp_batch, _config(3), STEPS)
    whole = {k: v for k, v in result.params.items() if not k.startswith("mid.")}
    whole.update(tiled_weights(engine.module.mid, "mid", result.params))
    engine.close()
    return max_abs_diff(whole, reference)


def _peak_section(rank):
    """The gathered-element peak over the second step's forward and backward (prefetch follows the trace)."""
    out = {}
    for tiled, input_grad in ((True, True), (True, False), (False, True)):
        model = PeakModel(tiled, input_grad)
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _config(3))
        tiles = [u.numel for u in engine.runtime.units]
        for step in range(2):
            if step == 1:
                engine.runtime.peak_live_elements = engine.runtime.live_elements
            engine.backward(model(*peak_batch(rank, step, 0)))
            engine.step()
        out[(tiled, input_grad)] = {"peak": engine.runtime.peak_live_elements, "units": tiles}
        engine.close()
    return out


def _copy_section(rank):
    """copy_params_from at stage 3 (a collective on partitioned tiles) equals nn.Linear's output."""
    torch.manual_seed(11)
    plain = nn.Linear(20, 12)
    model = nn.Sequential(zero_core.TiledLinear(20, 12, in_splits=3, out_splits=2))
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters()), _config(3))
    model[0].copy_params_from(plain)
    x = torch.randn(4, 20)
    with torch.no_grad():
        return (model(x) - plain(x)).abs().max().item()


def tiled_worker(rank, world_size):
    from stage3_support import capture

    return {name: capture(fn, rank) for name, fn in
            {"train": _train_section, "block": _block_section, "peak": _peak_section, "copy": _copy_section,
             "return_bias": _return_bias_section}.items()}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(tiled_worker, 2, timeout=150)


def _section(ranks, name):
    from stage3_support import unwrap

    return [unwrap(found[name]) for found in ranks]


@pytest.mark.parametrize("variant", VARIANTS)
def test_equals_linear_with_copied_params(variant):
    in_splits, out_splits, bias, already_split, combine = variant
    torch.manual_seed(1)
    plain = nn.Linear(HIDDEN, WIDE, bias=bias)
    tiled = zero_core.TiledLinear(HIDDEN, WIDE, bias, in_splits, out_splits, already_split, combine,
                                  init_linear=plain)
    x = torch.randn(5, HIDDEN, requires_grad=True)
    pieces = [x[..., tiled.in_parts[i]:tiled.in_parts[i + 1]] for i in range(in_splits)]
    out = tiled(pieces if already_split and in_splits > 1 else x)
    out = out if combine else torch.cat(out, dim=-1)
    torch.testing.assert_close(out, plain(x), atol=1e-6, rtol=1e-6)
    # The bias sits in each row's last tile only.
    assert [t.bias is not None for t in tiled.tiles()] == [bias and c == in_splits - 1
                                                          for _ in range(out_splits) for c in range(in_splits)]


def test_deepspeed_split_sizes_and_errors():
    layer = zero_core.TiledLinear(10, 7, in_splits=3, out_splits=2)
    assert layer.in_parts == [0, 4, 7, 10] and layer.out_parts == [0, 4, 7]
    assert [tuple(t.weight.shape) for t in layer.tiles()][:3] == [(4, 4), (4, 3), (4, 3)]
    with pytest.raises(ValueError, match="in_splits"):
        zero_core.TiledLinear(4, 4, in_splits=5)
    with pytest.raises(ValueError, match="bias"):
        zero_core.TiledLinear(4, 4, bias=False).copy_params_from(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="2 input pieces"):
        zero_core.TiledLinear(4, 4, in_splits=2, input_is_already_split=True)([torch.ones(1, 4)])


def test_estimator_counts_two_tiles_gathered():
    from zero_core.tools.estimator import estimate_stage

    config = {"stage": 3, "stage3_param_persistence_threshold": 0}
    with torch.device("meta"):
        tiled = nn.Sequential(nn.Linear(8, 64), zero_core.TiledLinear(64, 64, in_splits=4, out_splits=4))
        plain = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64))
    live = {name: estimate_stage(m, config, world_size=2, precision="fp32").live_params
            for name, m in (("tiled", tiled), ("plain", plain))}
    assert live["plain"] == 4 * (8 * 64 + 64 + 64 * 64 + 64)
    assert live["tiled"] == 4 * (8 * 64 + 64 + 2 * (16 * 16 + 16))  # the other layer, a tile and the next


def tiled_head():
    """For zero-estimate: an 8 -> 64 layer, then a 64 x 64 layer tiled 4 x 4."""
    return nn.Sequential(nn.Linear(8, 64), zero_core.TiledLinear(64, 64, in_splits=4, out_splits=4))


def plain_head():
    return nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 64))


def test_zero_estimate_counts_the_tiled_peak(tmp_path):
    from zero_core.tools.estimate_cli import run as cli

    config = tmp_path / "zero3.json"
    config.write_text('{"stage": 3, "stage3_param_persistence_threshold": 0}')

    def live_params(factory: str) -> float:
        out = cli(["--model", f"test_tiled_linear:{factory}", "--world-size", "2", "--stages", "3", "--unit", "B",
                   "--precision", "fp32", "--device", "cpu", "--config", str(config)])
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("|")]
        return float(rows[-1][rows[0].index("live params")])

    assert live_params("plain_head") == 4 * (8 * 64 + 64 + 64 * 64 + 64)
    assert live_params("tiled_head") == 4 * (8 * 64 + 64 + 2 * (16 * 16 + 16))  # the other layer and two tiles


@pytest.mark.timeout(200)
def test_trains_to_ddp_weights_at_stages_1_to_3(ranks):
    for diffs in _section(ranks, "train"):
        assert len(diffs) == 3 * len(VARIANTS)
        bad = {k: v for k, v in diffs.items() if not v < TOL}
        assert not bad, f"runs that left DDP's weights: {bad}"


@pytest.mark.timeout(200)
def test_tiles_are_units_inside_a_block(ranks):
    for found in _section(ranks, "block"):
        assert found["diff"] < TOL
        tiles = [f"blocks.{b}.up.linears.{r}.{c}" for b in range(2) for r in range(2) for c in range(2)]
        # One unit per tile, and the rest of each block one owner (two optimizer groups: matrices, vectors).
        assert set(tiles) <= set(found["owners"]), found["owners"]
        assert {"blocks.0", "blocks.1"} <= set(found["owners"])


@pytest.mark.timeout(200)
def test_peak_is_one_tile_plus_the_next(ranks):
    for found in _section(ranks, "peak"):
        tiled, first_layer, plain = found[(True, True)], found[(True, False)], found[(False, True)]
        layer = 64 * 64 + 64
        assert len(tiled["units"]) == 16  # one unit per tile (one optimizer group)
        target = layer // 16 + max(tiled["units"])  # 1/16 of the layer, plus the next tile prefetched
        assert tiled["peak"] <= target, (tiled, target)
        assert first_layer["peak"] <= target, first_layer  # released once its gradients are in
        assert plain["peak"] >= layer, plain  # untiled, the whole layer is gathered at once


@pytest.mark.timeout(200)
def test_copy_params_from_at_stage_3(ranks):
    assert all(diff < 1e-6 for diff in _section(ranks, "copy"))


def test_return_bias_trains_to_ddp_weights_at_stage_3(ranks):
    assert all(diff < TOL for diff in _section(ranks, "return_bias"))


@pytest.mark.parametrize("bias", [True, False])
def test_return_bias_equals_its_untiled_layer(bias):
    torch.manual_seed(2)
    plain = LinearReturnBias(HIDDEN, WIDE, bias=bias)
    tiled = zero_core.TiledLinearReturnBias(HIDDEN, WIDE, bias, in_splits=3, out_splits=2,
                                            linear_cls=LinearReturnBias, init_linear=plain)
    x = torch.randn(5, HIDDEN)
    out, out_bias = tiled(x)
    expected, expected_bias = plain(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    if bias:  # passed through, never summed into the output
        torch.testing.assert_close(out_bias, expected_bias, atol=0, rtol=0)
    else:
        assert out_bias is None
    rows = zero_core.TiledLinearReturnBias(HIDDEN, WIDE, in_splits=3, out_splits=2, combine_out_splits=False,
                                           linear_cls=LinearReturnBias, init_linear=LinearReturnBias(HIDDEN, WIDE))
    assert [tuple(o.shape) + tuple(b.shape) for o, b in rows(x)] == [(5, 9, 9), (5, 9, 9)]
    with pytest.raises(TypeError, match="linear_cls must return"):
        zero_core.TiledLinearReturnBias(HIDDEN, WIDE, in_splits=2)(x)  # nn.Linear returns the output alone
