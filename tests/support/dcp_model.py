"""The tiny model, data and optimizer of the DCP takeover fixtures (tests/checkpoint/fixtures/dcp/), shared by the
script that made them and the tests that load them. Changing anything here invalidates the checked-in fixtures:
regenerate them with ``python tests/checkpoint/fixtures/dcp/make_fixtures.py``.

Odd sizes and biases everywhere, so shards of 2 or 3 ranks cut rows and parameters unevenly. The global batch
of each step has 12 rows, split evenly over 1, 2 or 3 ranks (each rank's loss is its rows' mean, and the
gradients are averaged, so every world size takes the same steps as one process).
"""

from __future__ import annotations

import torch

GLOBAL_BATCH = 12
IN, HIDDEN, MIDDLE, OUT = 11, 45, 31, 7
# Not torch's defaults, so a load that dropped the saved hyper-parameters shows in the weights.
ADAMW = {"lr": 3e-2, "betas": (0.85, 0.97), "eps": 1e-7, "weight_decay": 0.05}


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, MIDDLE)
        self.norm = torch.nn.LayerNorm(MIDDLE)
        self.out = torch.nn.Linear(MIDDLE, OUT)
        # a buffer drawn from the seed: a model built with another seed has another one until a load brings it
        self.register_buffer("shift", torch.randn(OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.mid(torch.tanh(self.inp(x)))))) + self.shift


def build(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def optimizer(model: torch.nn.Module, **overrides) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), **{**ADAMW, **overrides})


def build_fsdp2(seed: int = 0, **optimizer_overrides):
    """The model under FSDP2 (each Linear and the LayerNorm a unit, then the root) on this process group's
    ranks (CPU, gloo), and its AdamW."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(seed)
    for module in (model.inp, model.mid, model.norm, model.out):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, optimizer(model, **optimizer_overrides)


def batch(step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step ``step``'s global batch."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=generator)
    rows = GLOBAL_BATCH // world_size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def loss_of(model, step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    x, y = batch(step, rank, world_size)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(steps: int) -> tuple[dict[str, torch.Tensor], torch.optim.AdamW]:
    """One plain process training ``steps`` steps on the whole batches: the weights every run must end with."""
    model = build()
    adamw = optimizer(model)
    for step in range(steps):
        loss_of(model, step).backward()
        adamw.step()
        adamw.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, adamw
