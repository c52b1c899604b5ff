"""The step copies 16-bit gradients to fp32 one tile at a time (``sub_group_size``): at 2 ranks under bf16, with
clipping and an LR scheduler, stages 1-3 end with the same weights as with one tile, and no call of the optimizer's
step ever sees more than a tile of gradient elements (a tile holds whole pieces: a piece above the tile steps
alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from distributed import run_distributed
from stage3_support import full_params, max_abs_diff

TILE = 96
STEPS = 3


class CountingAdamW(torch.optim.AdamW):
    """AdamW that records, at each step() call, how many gradient elements its parameters hold."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[int] = []

    def step(self, closure=None):
        grads = [p.grad.numel() for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.seen.append(sum(grads) if len(grads) > 1 else 0)  # one piece above the tile is a tile alone
        return super().step(closure)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(6) for layer in (nn.Linear(8, 8), nn.Tanh())])


def train(rank: int, config: dict) -> tuple[dict, list[int]]:
    model = build()
    optimizer = CountingAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine = zero_core.setup(model, optimizer, {"bf16": {"enabled": True}, "gradient_clipping": 0.05, **config})
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (step + 1))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=generator).to(torch.bfloat16)
        engine.backward(model(x).float().pow(2).mean())
        engine.step()
        scheduler.step()
    weights = full_params(model)
    engine.close()
    return weights, optimizer.seen


def tiled_worker(rank: int, world_size: int) -> dict:
    found = {}
    for stage in (1, 2, 3):
        config = {"stage": stage, "param_persistence_threshold": 0}
        whole, whole_seen = train(rank, config)
        tiled, tiled_seen = train(rank, {**config, "sub_group_size": TILE})
        found[stage] = {"diff": max_abs_diff(whole, tiled), "whole_calls": len(whole_seen),
                        "tiled_calls": len(tiled_seen), "largest_tile": max(tiled_seen)}
    return found


@pytest.mark.timeout(240)
def test_tiled_step_equals_one_tile_and_never_holds_more_than_a_tile():
    for rank, found in enumerate(run_distributed(tiled_worker, 2, timeout=200)):
        for stage, result in found.items():
            where = f"rank {rank}, stage {stage}"
            assert result["diff"] == 0.0, f"{where}: tiled step {result['diff']:.2e} away from the one-tile step"
            assert result["whole_calls"] == STEPS, where
            assert result["tiled_calls"] > STEPS, f"{where}: the step was not tiled ({result})"
            assert 0 < result["largest_tile"] <= TILE, f"{where}: a step call held {result['largest_tile']} elements"
