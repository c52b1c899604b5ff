"""A bucket shard stepped as one tensor (zero_core/optim/flat_step.py) gives exactly the per-piece step on buckets
small enough for torch to step on one thread (large ones differ in the last bit of fp32; flat_step.py): at 2 ranks,
stages 1-3, Adam/AdamW/SGD, with a parameter that gets no gradient in some steps (those buckets step per piece and
are adopted again after) and the optimizer's state replaced mid-run by ``load_state_dict``: weights and every
piece's optimizer state are bit-identical to training with the flat step turned off, and the flat step did run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from distributed import run_distributed
from stage3_support import full_params

STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(13, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.a(x).relu()
        return (self.b(h) + (self.c(h) if step % 3 != 1 else 0)).square().mean()  # c idle in steps 1 and 4


def train(rank: int, stage: int, make_optimizer, flat: bool) -> tuple[dict, list, int]:
    from zero_core.optim import flat_step, master_shards

    master_shards.ELEMENTWISE = flat_step.ELEMENTWISE if flat else ()
    flat_steps = []
    after_step = flat_step.FlatBucket.after_step
    flat_step.FlatBucket.after_step = lambda bucket: (flat_steps.append(1), after_step(bucket))[1]
    try:
        torch.manual_seed(0)
        model = Net()
        optimizer = make_optimizer(model.parameters())
        engine = zero_core.setup(model, optimizer, {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50,
                                                    "ignore_unused_parameters": True, "param_persistence_threshold": 0})
        generator = torch.Generator().manual_seed(rank)
        for step in range(STEPS):
            engine.backward(engine.module(torch.randn(4, 7, generator=generator), step))
            engine.step()
            if step == 2:
                optimizer.load_state_dict(optimizer.state_dict())  # fresh state tensors: adopted again
        state = [{k: v.clone() for k, v in optimizer.state[m].items()} for g in optimizer.param_groups
                 for m in g["params"]]
        weights = full_params(model)
        engine.close()
    finally:
        flat_step.FlatBucket.after_step = after_step
        master_shards.ELEMENTWISE = flat_step.ELEMENTWISE
    return weights, state, len(flat_steps)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def flat_worker(rank: int, world_size: int, name: str) -> dict:
    found = {}
    for stage in (1, 2, 3):
        flat_weights, flat_state, flat_steps = train(rank, stage, OPTIMIZERS[name], flat=True)
        weights, state, _ = train(rank, stage, OPTIMIZERS[name], flat=False)
        same_state = len(flat_state) == len(state) and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(flat_state, state))
        found[stage] = {"weights": all(torch.equal(flat_weights[n], weights[n]) for n in weights),
                        "state": same_state, "flat_steps": flat_steps}
    return found


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_flat_step_matches_per_piece_step(name):
    for found in run_distributed(flat_worker, 2, name, timeout=240):
        for stage, result in found.items():
            assert result["weights"] and result["state"], (stage, result)
            assert result["flat_steps"] > 0, (stage, result)
