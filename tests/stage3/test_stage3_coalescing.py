"""Stage 3's coalesced collectives and block units at world size 2, against DDP on the same data (one spawn).

A ModuleList of four blocks of two Linear layers (each layer: a weight unit and a bias unit, since the optimizer
puts biases in their own group), every parameter partitioned:
- defaults: one all-gather per step (the prefetch batch covers the model) and one reduce-scatter (the reduction
  bucket covers it), each of exactly the model's elements;
- prefetch_bucket_size and reduce_bucket_size of one block: the forward's gathers go block 0 + 1, then 2, then 3
  (3 all-gathers), backward needs none (max_reuse_distance keeps them), and one reduce-scatter per block (4);
- a child inside a block that one rank skips in one step (buckets smaller than a block and blocks gathered again
  in backward, so reductions interleave with gathers): its gradient counts as zero there, once the block's backward is over, as with
  DistributedDataParallel(find_unused_parameters=True).
- a transformer whose LM head is tied to the token embedding: by default (max_reuse_distance) the embedding's
  unit, used by the head's backward, is kept for the embedding's backward, so every unit is all-gathered once
  per step; with max_reuse_distance 0 the embedding is gathered again in backward.
Every run trains to DDP's weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from reference import make_optimizer
from stage3_support import full_params, max_abs_diff

WIDTH, BLOCKS, STEPS, SKIP_AT = 16, 4, 3, 1
BLOCK_NUMEL = 2 * (WIDTH * WIDTH + WIDTH)
PSI = BLOCKS * BLOCK_NUMEL
TOLERANCE = 1e-5
PARTITIONED = {"stage": 3, "param_persistence_threshold": 0}
ONE_BLOCK = {**PARTITIONED, "prefetch_bucket_size": BLOCK_NUMEL, "reduce_bucket_size": BLOCK_NUMEL}


class Block(nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH) if gated else None

    def forward(self, x, skip_gate=False):
        x = x + self.fc2(torch.tanh(self.fc1(x)))
        return x if self.gate is None or skip_gate else x * torch.sigmoid(self.gate(x))


class Blocks(nn.Module):
    def __init__(self, gated: bool = False):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.blocks = nn.ModuleList([Block(gated) for _ in range(BLOCKS)])

    def forward(self, x, y, skip_gate_of=-1):
        for index, block in enumerate(self.blocks):
            x = block(x, skip_gate=index == skip_gate_of)
        return F.mse_loss(x, y)


def data(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)


def tied_transformer_batch(rank, step, skip_gate_of=-1):
    from models import transformer_batch

    return transformer_batch(rank, step, 0)


def train(rank, config, gated=False, tied=False):
    """Weights after STEPS steps, and the collectives of the last step (the trace is agreed by then). With
    ``gated``, rank 1 skips block 2's gate at step SKIP_AT; ``tied``: the transformer with a tied head."""
    from models import TinyTransformer

    model = TinyTransformer() if tied else Blocks(gated)
    batch = tied_transformer_batch if tied else data
    optimizer = make_optimizer(model)
    if config is None:
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        forward, backward = ddp, lambda loss: loss.backward()
        step = lambda: (optimizer.step(), optimizer.zero_grad())  # noqa: E731
    else:
        engine = zero_core.setup(model, optimizer, config)
        forward, backward, step = model, engine.backward, engine.step
    for index in range(STEPS):
        if config is not None and index == STEPS - 1:
            engine.reset_comm_stats()
        skip = 2 if gated and rank == 1 and index == SKIP_AT else -1
        inputs = batch(rank, index, skip_gate_of=skip) if tied else (*batch(rank, index), skip)
        backward(forward(*inputs))
        step()
    stats = engine.comm_stats() if config is not None else {}
    return full_params(model), {k: (v["calls"], v["elements"]) for k, v in stats.items() if k != "all_reduce"}


def runs(rank, world_size):
    found = {}
    reference = train(rank, None)[0]
    for name, config in (("defaults", PARTITIONED), ("one block", ONE_BLOCK)):
        weights, collectives = train(rank, config)
        found[name] = {"diff": max_abs_diff(weights, reference), "collectives": collectives}
    gated_reference = train(rank, None, gated=True)[0]
    # Buckets smaller than a block, blocks gathered again in backward: the other rank's reductions interleave
    # with those gathers, so the skipping rank's must too.
    regather = {**ONE_BLOCK, "max_reuse_distance": 0}
    found["skipped child"] = {"diff": max_abs_diff(train(rank, regather, gated=True)[0], gated_reference)}
    tied_reference = train(rank, None, tied=True)[0]
    for name, config in (("tied", PARTITIONED), ("tied, no reuse", {**PARTITIONED, "max_reuse_distance": 0})):
        weights, collectives = train(rank, config, tied=True)
        found[name] = {"diff": max_abs_diff(weights, tied_reference), "collectives": collectives}
    return found


@pytest.fixture(scope="module")
def results():
    return run_distributed(runs, 2, timeout=240)


@pytest.mark.timeout(300)
def test_coalesced_stage3_trains_to_ddps_weights(results):
    for rank, found in enumerate(results):
        for name, run in found.items():
            assert run["diff"] <= TOLERANCE, f"rank {rank} {name}: max |weight - DDP| = {run['diff']}"


@pytest.mark.timeout(300)
def test_one_all_gather_and_one_reduce_scatter_per_step_by_default(results):
    for found in results:
        assert found["defaults"]["collectives"] == {"all_gather": (1, PSI), "reduce_scatter": (1, PSI)}, found


@pytest.mark.timeout(300)
def test_collectives_follow_the_bucket_sizes(results):
    for found in results:
        assert found["one block"]["collectives"] == {"all_gather": (BLOCKS - 1, PSI),
                                                     "reduce_scatter": (BLOCKS, PSI)}, found


@pytest.mark.timeout(300)
def test_a_tied_embedding_is_gathered_once_per_step(results):
    """Each unit of the tied transformer is all-gathered once per step (its padded elements summed), the
    embedding's included: the head's backward keeps it for the embedding's. Without reuse it is gathered again."""
    from models import TinyTransformer
    from stage3_support import expected_units

    model = TinyTransformer()
    once = sum(u["padded"] for u in expected_units(model, 2))
    embedding = sum(u["padded"] for u in expected_units(model, 2) if u["module"] == "tok")
    for found in results:
        assert found["tied"]["collectives"]["all_gather"][1] == once, found["tied"]
        assert found["tied, no reuse"]["collectives"]["all_gather"][1] >= once + embedding, found["tied, no reuse"]
