"""What follows the device when a LightningModule is partly partitioned (built under zero_core.Init): every
subtree without partitioned parameters (metrics, parameter-free modules), and nothing partitioned. The move
itself is checked on CUDA by tests/gpu/."""

from __future__ import annotations

import torch
import torchmetrics
from torch import nn

from distributed import run_distributed


class WithMetrics(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
        self.head = nn.Linear(3, 2)
        self.metric = torchmetrics.MeanMetric()
        self.scale = nn.Module()
        self.scale.register_buffer("factor", torch.ones(2))


def _visited(rank, world_size):
    import zero_core
    from lightning_zero.placement import apply_around_partitioned

    with zero_core.Init(config={"stage": 3, "stage3_param_persistence_threshold": 0}):
        partitioned = nn.Linear(4, 3)
    model = WithMetrics()
    model.body[0] = partitioned  # one subtree partitioned, the rest whole
    names = {m: n for n, m in model.named_modules()}
    seen = []
    apply_around_partitioned(model, lambda subtree: seen.append(names[subtree]))
    return sorted(seen)


def test_everything_but_partitioned_parameters_follows_the_device():
    (seen,) = run_distributed(_visited, 1, timeout=60)
    assert seen == ["body.1", "head", "metric", "scale"]  # not body.0 (partitioned), nor its parents
