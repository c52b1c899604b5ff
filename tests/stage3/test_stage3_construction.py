"""Sharded construction for ZeRO stage 3: `zero_core.Init` and the meta device.

A model whose full fp32 AdamW states (16 bytes per parameter) exceed a per-rank budget is built under Init,
never held whole, and trains exactly as the plain model under DDP; Init gives bitwise the weights of a plain
construction with the same seed, including initialisation that runs on already-partitioned submodules; a meta
model materialised by setup matches a plain one. One spawn runs every section.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import zero_core
from models import VOCAB
from reference import EngineDriver, make_optimizer, make_scheduler, train_ddp, train_loop
from stage3_support import (WideMLP, batch, build, capture, expected_units, full_params, max_abs_diff,
                            module_gather_numel, rank_batches, run_once, train_engine, unwrap)

WORLD_SIZE = 2
STEPS = 10
WEIGHT_TOLERANCE = 1e-5
BUDGET_BYTES_PER_PARAM = 12  # what a rank may hold per parameter: less than the 16 of full fp32 AdamW states
LARGE = {"depth": 8, "width": 96}
FULL_STATE_BYTES = 16  # fp32 weight + fp32 gradient + Adam's two fp32 moments, per parameter
ADAM_STEP_BYTES = 4
FP32_BYTES = 4


class LargeMLP(WideMLP):
    """WideMLP over the budget, re-initialised by ``self.apply`` once its layers exist (under Init: partitioned)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed, **LARGE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=module.in_features ** -0.5)
            nn.init.zeros_(module.bias)


class BatchNormMLP(nn.Module):
    """Buffers (BatchNorm's running statistics) that reset_parameters() initialises."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(13, 16)
            self.norm = nn.BatchNorm1d(16)
            self.out = nn.Linear(16, 7)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.out(torch.tanh(self.norm(self.inp(x)))), y)


class InitHeavy(nn.Module):
    """GPT-style initialisation after the submodules exist (so, under Init, after they are partitioned); it
    draws from the global random generator (``seed`` is unused: the caller seeds)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.layers = nn.ModuleList([nn.Linear(24, 24) for _ in range(3)])
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, VOCAB, bias=False)
        self.apply(self._init_weights)
        nn.init.normal_(self.emb.weight, std=0.02)
        nn.init.zeros_(self.layers[0].bias)
        nn.init.uniform_(self.norm.weight, 0.9, 1.1)
        with torch.no_grad():
            self.head.weight.mul_(0.5)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.05)
            if module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)


# -- a model over the budget -----------------------------------------------------------------------------------
def build_large_sharded(rank: int) -> dict:
    config = {"stage": 3, "param_persistence_threshold": 0, "max_live_parameters": 0}
    with zero_core.Init(config=config) as init:
        model = LargeMLP()
    held_after_init = sum(p.untyped_storage().nbytes() for p in model.parameters())
    reference = train_ddp(LargeMLP, partial(batch, "wide"), STEPS)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    losses, _ = train_loop(EngineDriver(engine), scheduler, rank_batches(partial(batch, "wide")), STEPS)
    return {"peak_gathered": init.peak_gathered_elements, "held_after_init": held_after_init,
            "bytes": engine.memory_stats(), "peak_live": engine.runtime.peak_live_elements,
            "max_dw": max_abs_diff(full_params(model), reference.params), "losses": losses,
            "masters": sum(len(group["params"]) for group in engine.optimizer.param_groups)}


# -- Init gives the plain construction's weights -------------------------------------------------------------
def init_weights(rank: int) -> dict:
    """Mismatching parameter names, before and after setup, per construction."""
    found = {}
    constructions = (("InitHeavy, same seed", InitHeavy, 3), ("InitHeavy, seed per rank", InitHeavy, 3 + rank),
                     ("TinyTransformer (tied)", partial(build, "transformer"), 0))
    for label, model_fn, seed in constructions:
        torch.manual_seed(3)
        expected = {n: p.detach().clone() for n, p in model_fn().named_parameters()}  # rank 0's values
        torch.manual_seed(seed)
        with zero_core.Init():
            model = model_fn()
        found[label + ", before setup"] = differing(full_params(model), expected)
        zero_core.setup(model, make_optimizer(model), {"stage": 3, "param_persistence_threshold": 0})
        found[label + ", after setup"] = differing(full_params(model), expected)
        found[label + ", tie kept"] = [] if label[0] == "I" or model.head.weight is model.tok.weight else ["head"]
    return found


def differing(got: dict, expected: dict) -> list[str]:
    return [n for n in expected if n not in got or not torch.equal(got[n], expected[n])]


def init_trains_like_ddp(rank: int) -> float:
    def under_init():
        with zero_core.Init():
            return build("transformer")

    reference = train_ddp(partial(build, "transformer"), partial(batch, "transformer"), STEPS)
    result, _ = train_engine(under_init, partial(batch, "transformer"), {"stage": 3, "param_persistence_threshold": 0},
                             STEPS)
    return max_abs_diff(result.params, reference.params)


# -- the meta device -------------------------------------------------------------------------------------------
def meta_matches_reset_parameters(rank: int) -> dict:
    """setup materialises meta parameters with each module's reset_parameters(), one module at a time in
    module order: seeded alike, a plain model re-initialised the same way holds bitwise the same weights."""
    found = {}
    for name in ("transformer", "mlp"):
        with torch.device("meta"):
            model = build(name)
        for buffer_name, buffer in build(name).named_buffers():  # a buffer no reset_parameters() sets is the user's
            model.get_submodule(buffer_name.rpartition(".")[0]).register_buffer(buffer_name.rpartition(".")[2], buffer)
        torch.manual_seed(11)
        zero_core.setup(model, make_optimizer(model), {"stage": 3, "param_persistence_threshold": 0})
        plain = build(name)
        torch.manual_seed(11)
        seen = set()  # the modules that register parameters first (a tied one is materialised once)
        for module in plain.modules():
            own = [p for p in module.parameters(recurse=False) if p not in seen]
            seen.update(own)
            if own:
                module.reset_parameters()
        found[name] = differing(full_params(model), {n: p.detach() for n, p in plain.named_parameters()})
    return found


def meta_copied_in_trains_like_ddp(rank: int) -> dict:
    """A meta model set up, then given the plain model's weights by rank 0 through GatheredParameters, trains
    exactly as the plain model under DDP (frozen layer included)."""
    found = {}
    for name in ("transformer", "mlp"):
        with torch.device("meta"):
            model = build(name)
        for buffer_name, buffer in build(name).named_buffers():  # buffers are the user's to materialise
            model.get_submodule(buffer_name.rpartition(".")[0]).register_buffer(buffer_name.rpartition(".")[2], buffer)
        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        engine = zero_core.setup(model, optimizer, {"stage": 3, "param_persistence_threshold": 0})
        source = dict(build(name).named_parameters()) if rank == 0 else None
        with zero_core.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    for param_name, param in model.named_parameters():
                        param.copy_(source[param_name])
        train_loop(EngineDriver(engine), scheduler, rank_batches(partial(batch, name)), STEPS)
        reference = train_ddp(partial(build, name), partial(batch, name), STEPS)
        found[name] = max_abs_diff(full_params(model), reference.params)
    return found


def meta_buffers(rank: int) -> dict:
    """Buffers built on the meta device: those a module's reset_parameters() initialises (BatchNorm) must work
    after setup; others must be an error at setup naming them, not a device error in the first forward."""
    found = {}
    for label, model_fn in (("BatchNorm", BatchNormMLP), ("OddMLP.input_scale", partial(build, "mlp"))):
        with torch.device("meta"):
            model = model_fn()
        try:
            engine = zero_core.setup(model, make_optimizer(model), {"stage": 3, "param_persistence_threshold": 0})
            engine.backward(model(*batch("mlp", rank, 0, 0)))
            engine.step()
            found[label] = {n: b.device.type for n, b in model.named_buffers()}
        except (RuntimeError, ValueError) as error:
            found[label] = str(error)
    return found


def worker(rank, world_size):
    return {"large": capture(build_large_sharded, rank), "init": capture(init_weights, rank),
            "init trains": capture(init_trains_like_ddp, rank),
            "meta reset": capture(meta_matches_reset_parameters, rank),
            "meta copied": capture(meta_copied_in_trains_like_ddp, rank), "meta buffers": capture(meta_buffers, rank)}


def results() -> list[dict]:
    return run_once(worker, WORLD_SIZE, timeout=300)


def sections(key: str) -> list:
    return [unwrap(result[key]) for result in results()]


@pytest.mark.timeout(400)
def test_model_over_the_rank_budget_is_built_sharded_and_trains():
    model = LargeMLP()
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    units = expected_units(model, WORLD_SIZE)
    budget = BUDGET_BYTES_PER_PARAM * psi
    assert FULL_STATE_BYTES * psi > budget  # the model really does not fit one rank's budget whole
    for rank, found in enumerate(sections("large")):
        states = sum(found["bytes"][k] for k in ("params", "grads", "fp32_master", "optimizer_state"))
        print(f"rank {rank}: Psi={psi}, full fp32 AdamW states {FULL_STATE_BYTES * psi} bytes, budget {budget}; "
              f"model states held {states} bytes ({found['bytes']}); peak gathered under Init "
              f"{found['peak_gathered']} elements (largest parameter {largest}); peak live in training "
              f"{found['peak_live']} elements")
        assert found["held_after_init"] == 0, "Init left parameters whole"
        assert found["peak_gathered"] <= -(-largest // WORLD_SIZE) * WORLD_SIZE, found["peak_gathered"]
        least = FULL_STATE_BYTES * psi / WORLD_SIZE
        most = FULL_STATE_BYTES * (psi / WORLD_SIZE + len(units)) + ADAM_STEP_BYTES * found["masters"]
        assert least <= states <= most, f"rank {rank}: {states} bytes, expected {least:.0f}..{most:.0f}"
        one_module = max(module_gather_numel(model, m, WORLD_SIZE) for m in model.modules())
        assert found["peak_live"] <= one_module, f"max_live_parameters=0, yet {found['peak_live']} gathered at once"
        held = states + found["bytes"]["buffers"] + FP32_BYTES * found["peak_live"]  # + scratch + gathered
        assert held <= budget, f"rank {rank}: holds {held} bytes at its peak, over the budget {budget}"
        assert found["max_dw"] <= WEIGHT_TOLERANCE, f"rank {rank}: differs from DDP by {found['max_dw']}"
        assert found["losses"][-1] < found["losses"][0]


@pytest.mark.timeout(400)
def test_init_gives_the_plain_constructions_weights_bitwise():
    for rank, found in enumerate(sections("init")):
        wrong = {label: names for label, names in found.items() if names}
        assert not wrong, f"rank {rank}: parameters that differ from a plain construction: {wrong}"


@pytest.mark.timeout(400)
def test_model_built_under_init_trains_like_ddp():
    for rank, max_dw in enumerate(sections("init trains")):
        assert max_dw <= WEIGHT_TOLERANCE, f"rank {rank}: differs from DDP by {max_dw}"


@pytest.mark.timeout(400)
def test_meta_model_materialised_by_setup_matches_reset_parameters():
    for rank, found in enumerate(sections("meta reset")):
        assert not any(found.values()), f"rank {rank}: parameters that differ: {found}"


@pytest.mark.timeout(400)
def test_meta_model_given_weights_by_rank_0_trains_like_ddp():
    for rank, found in enumerate(sections("meta copied")):
        assert all(d <= WEIGHT_TOLERANCE for d in found.values()), f"rank {rank}: max |w - w_ddp| {found}"


@pytest.mark.timeout(400)
def test_meta_buffers_are_materialised_or_named_in_an_error():
    for rank, found in enumerate(sections("meta buffers")):
        assert found["BatchNorm"] == {f"norm.{b}": "cpu" for b in ("running_mean", "running_var",
                                                                   "num_batches_tracked")}, f"rank {rank}: {found}"
        assert "input_scale" in found["OddMLP.input_scale"], f"rank {rank}: {found}"
