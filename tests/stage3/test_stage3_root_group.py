"""Stage 3's root group (zero_core/stage3/root_group.py): the modules outside the blocks are gathered by the root's
hooks, and still whenever they run outside the root's forward; the group forms only within the budgets.

One 2-rank spawn; every scenario trains under DDP and under the engine on the same batches, in the same job:
- an optimizer step inside the root's forward (Lightning's manual optimization), after which the members run
  again in the same forward: the step released the group, so their gates gather them one by one;
- a decoding loop after training that drives the members directly, outside any root forward;
- ``max_live_parameters`` below the group's size: no group, a hook per module, the same weights;
- a model without blocks: no group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from models import TinyTransformer, make_batch
from reference import make_optimizer
from stage3_support import capture, full_params, generate, max_abs_diff, unwrap

STEPS, TOLERANCE = 3, 1e-5
PARTITIONED = {"stage": 3, "param_persistence_threshold": 0}


class ManualSteps(nn.Module):
    """A root whose forward trains on two batches, stepping after each (backward and step inside the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyTransformer()
        self.backward, self.step = None, None  # set by the driver

    def forward(self, batches):
        losses = []
        for batch in batches:
            loss = self.model(*batch)
            self.backward(loss)
            self.step()
            losses.append(loss.detach())
        return torch.stack(losses)


def _batches(rank, step):
    return [make_batch("transformer", rank, step, micro) for micro in range(2)]


def manual_steps(rank: int, config) -> dict:
    """Weights after STEPS root calls, then greedy decoding through the submodules; under DDP when config is None."""
    root = ManualSteps()
    optimizer = make_optimizer(root)
    if config is None:
        ddp = DistributedDataParallel(root.model)
        root.model = ddp
        root.backward = lambda loss: loss.backward()
        root.step = lambda: (optimizer.step(), optimizer.zero_grad())
    else:
        engine = zero_core.setup(root, optimizer, config)
        root.backward, root.step = engine.backward, engine.step
    for step in range(STEPS):
        root(_batches(rank, step))
    model = root.model.module if config is None else root.model
    weights = full_params(model)
    model.eval()
    tokens, logits = generate(model, make_batch("transformer", 0, 99, 0)[0], 3)  # the members driven directly
    group = [] if config is None else engine.runtime.root_group.members
    return {"weights": weights, "tokens": tokens, "logits": logits, "group": len(group)}


def no_blocks(rank: int) -> int:
    """A model with no ModuleList of blocks keeps a hook per module: no group."""
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    engine = zero_core.setup(model, make_optimizer(model), PARTITIONED)
    return len(engine.runtime.root_group.members)


def worker(rank, world_size):
    reference = manual_steps(rank, None)
    found = {"no blocks": capture(no_blocks, rank)}
    # TinyTransformer's group (tok, pos, ln_f, head) holds 37*22 + 9*22 + 2*22 elements; 500 is below it.
    for name, config in (("group", PARTITIONED), ("no group", {**PARTITIONED, "max_live_parameters": 500})):
        def compare(config=config):
            got = manual_steps(rank, config)
            return {"weights": max_abs_diff(got["weights"], reference["weights"]),
                    "tokens": torch.equal(got["tokens"], reference["tokens"]),
                    "logits": (got["logits"] - reference["logits"]).abs().max().item(), "group": got["group"]}
        found[name] = capture(compare)
    return found


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2, timeout=200)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name, members", [("group", 4), ("no group", 0)])
def test_steps_inside_the_root_forward_and_direct_calls_match_ddp(results, name, members):
    for rank, found in enumerate(results):
        got = unwrap(found[name])
        assert got["group"] == members, (rank, name, got)
        assert got["weights"] <= TOLERANCE, (rank, name, got)
        assert got["tokens"] and got["logits"] <= TOLERANCE, (rank, name, got)


@pytest.mark.timeout(260)
def test_a_model_without_blocks_has_no_group(results):
    for found in results:
        assert unwrap(found["no blocks"]) == 0
