"""A tiny language model whose head a patched forward can read directly (as TRL's fused LM head does), shared
by the stage-3 read-in-forward test, the Accelerate patched-forward script and the GPU tier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ = 19, 12, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """``final_norm=False`` leaves out the norm after the blocks, as the Accelerate script's model always had.

    A patched forward calls ``self.hidden(tokens)`` and then reads ``lm_head.weight``: compiled, that read lands
    in a graph after the break at the blocks' hooks, which stage 3 gathers first ([Note: compiled reads] in
    zero_core/stage3/partitioned_param.py)."""

    def __init__(self, final_norm: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def hidden(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens, targets):
        return F.cross_entropy(self.lm_head(self.hidden(tokens)).float().flatten(0, 1), targets.flatten())


def lm_batch(step: int, rank: int):
    """Inputs and next-token targets of one step on one rank."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
