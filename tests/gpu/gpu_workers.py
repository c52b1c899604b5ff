"""What the GPU tests run in their own process: one rank on one GPU (NCCL), plain bf16 training against the
engine's stages on the same model and data, with peak memory."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 6
VOCAB, WIDTH, LAYERS, SEQ, BATCH = 512, 256, 4, 64, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float().flatten(0, 1), tokens.roll(-1, 1).flatten())


def batches(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(STEPS)]


def plain(device) -> dict:
    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for tokens in batches(device):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "peak": torch.cuda.max_memory_allocated(),
            "weights": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}


def engine_run(device, stage: int) -> dict:
    import zero_core

    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.reset_peak_memory_stats()
    engine = zero_core.setup(model, optimizer, {"stage": stage, "bf16": {"enabled": True},
                                                "stage3_param_persistence_threshold": 0})
    losses = []
    for tokens in batches(device):
        loss = engine.module(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "peak": torch.cuda.max_memory_allocated(), "memory": engine.memory_stats(),
            "weights": {n: weights[n] for n, _ in model.named_parameters()}}


def main(out: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results = {"plain": plain(device)}
    for stage in (1, 2, 3):
        results[f"zero{stage}"] = engine_run(device, stage)
    dist.destroy_process_group()
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
