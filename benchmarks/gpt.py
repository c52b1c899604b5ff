"""The benchmark model: a small GPT (pre-norm blocks, tied LM head) and its deterministic data.

Every implementation builds the same weights from ``GPTConfig.seed`` and trains on the same batches: rank r
at step s always gets ``batch(config, r, s)``. ``build_gpt()`` with no argument is the default benchmark model,
usable as ``zero-estimate --model benchmarks.gpt:build_gpt``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model and batch shape; the defaults give about 6.9M parameters and a step of a fraction of a second."""

    vocab: int = 8192
    d_model: int = 256
    n_layer: int = 6
    n_head: int = 8
    seq_len: int = 64
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "seed" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, final norm, LM head tied to the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList([Block(config.d_model, config.n_head) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) weights, zero biases (so the first loss is about ln(vocab))."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_gpt(config: GPTConfig | None = None) -> GPT:
    """The model with weights drawn from ``config.seed`` (the global RNG is left untouched)."""
    config = config or GPTConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return GPT(config)


def num_params(model: nn.Module) -> int:
    """Ψ: trainable elements, each tied weight once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def batch(config: GPTConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets of a learnable sequence: each token is a fixed function of the last."""
    generator = torch.Generator().manual_seed(config.seed * 7919 + 1_000_003 * rank + step)
    start = torch.randint(0, config.vocab, (config.batch_size, 1), generator=generator)
    offsets = torch.arange(config.seq_len + 1) * 7
    sequence = (start * 31 + offsets) % config.vocab
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()
