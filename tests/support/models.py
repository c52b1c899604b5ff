"""Small models with awkward shapes, and the fixed data every implementation trains on.

Sizes divide by neither 2 nor 4, so shards and buckets never line up with parameter boundaries.
Each model's forward takes a batch and returns the loss (computed in fp32), so one training loop
drives every model. Models and batches are deterministic from their seeds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, D_MODEL, HEADS, FFN, SEQ = 37, 22, 2, 45, 9
MLP_SIZES = (13, 29, 17, 7)
BATCH = 3


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        # No bias: a key bias gets an exactly-zero gradient (softmax ignores a per-row shift), so Adam
        # would turn its round-off noise into full-size updates and no parity test could pass.
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, FFN)
        self.fc2 = nn.Linear(FFN, D_MODEL)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, D_MODEL))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """GPT-style: token + position embeddings, 2 blocks, LM head tied to the token embedding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Embedding(SEQ, D_MODEL)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.ln_f = nn.LayerNorm(D_MODEL)
            self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
            # GPT-style small embeddings: N(0, 1) rows through the tied head give huge initial logits.
            nn.init.normal_(self.tok.weight, std=0.1)
            nn.init.normal_(self.pos.weight, std=0.1)
        self.head.weight = self.tok.weight  # tied: one Parameter object, two uses

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class OddMLP(nn.Module):
    """13 -> 29 -> 17 -> 7 with a frozen middle layer and a float buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        n_in, n_hidden, n_frozen_out, n_out = MLP_SIZES
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(n_in, n_hidden)
            self.norm = nn.LayerNorm(n_hidden)
            self.frozen = nn.Linear(n_hidden, n_frozen_out)
            self.out = nn.Linear(n_frozen_out, n_out)
        self.frozen.requires_grad_(False)
        self.register_buffer("input_scale", torch.linspace(0.5, 1.5, n_in))

    def forward(self, x, y):
        h = F.gelu(self.norm(self.inp(x * self.input_scale)))
        h = F.gelu(self.frozen(h))
        return F.mse_loss(self.out(h).float(), y.float())


def _generator(rank: int, step: int, micro: int, salt: int) -> torch.Generator:
    # Distinct for every (rank, step, micro-step) in any range a test uses.
    return torch.Generator().manual_seed(salt + 1_000_003 * rank + 1_009 * step + micro)


def transformer_batch(rank, step, micro, dtype=torch.float32):
    """Tokens and targets of a learnable per-token map; token ids stay long whatever `dtype` is."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=_generator(rank, step, micro, salt=17))
    return tokens, (3 * tokens + 1) % VOCAB


def mlp_batch(rank, step, micro, dtype=torch.float32):
    """Inputs and targets of a fixed smooth teacher; floats in `dtype` (the model's dtype)."""
    n_in, n_out = MLP_SIZES[0], MLP_SIZES[-1]
    x = torch.randn(BATCH, n_in, generator=_generator(rank, step, micro, salt=29))
    teacher = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(7)) / n_in**0.5
    return x.to(dtype), torch.tanh(x @ teacher).to(dtype)


MODELS = {"transformer": (TinyTransformer, transformer_batch), "mlp": (OddMLP, mlp_batch)}


def build_model(name: str, seed: int = 0) -> nn.Module:
    return MODELS[name][0](seed)


def make_batch(name: str, rank: int, step: int, micro: int, dtype=torch.float32):
    return MODELS[name][1](rank, step, micro, dtype)


def trainable_numel(model: nn.Module) -> int:
    """Psi in the ZeRO paper: elements the optimizer updates (parameters() lists tied weights once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def frozen_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def trainable_tensor_count(model: nn.Module) -> int:
    return sum(1 for p in model.parameters() if p.requires_grad)


# -- a GAN: two networks, two optimizers ---------------------------------------------------------------------
GAN_NOISE, GAN_DATA = 8, 13


def generator_loss(generator: nn.Module, discriminator: nn.Module, noise: torch.Tensor) -> torch.Tensor:
    return F.softplus(-discriminator(generator(noise)).float()).mean()


def discriminator_loss(generator: nn.Module, discriminator: nn.Module, noise: torch.Tensor,
                       real: torch.Tensor) -> torch.Tensor:
    fake = generator(noise).detach()
    return F.softplus(-discriminator(real).float()).mean() + F.softplus(discriminator(fake).float()).mean()


class GanPair(nn.Module):
    """A generator and a discriminator; ``forward(noise, real, which)`` is either network's loss, so that a
    wrapper that must see every forward (DDP) sees it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.generator = nn.Sequential(nn.Linear(GAN_NOISE, 32), nn.Tanh(), nn.Linear(32, GAN_DATA))
        self.discriminator = nn.Sequential(nn.Linear(GAN_DATA, 24), nn.LeakyReLU(0.2), nn.Linear(24, 1))

    def forward(self, noise: torch.Tensor, real: torch.Tensor, which: str) -> torch.Tensor:
        if which == "generator":
            return generator_loss(self.generator, self.discriminator, noise)
        return discriminator_loss(self.generator, self.discriminator, noise, real)


def gan_dataset(count: int = 32) -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    noise, real = torch.randn(count, GAN_NOISE, generator=gen), torch.randn(count, GAN_DATA, generator=gen) + 1.0
    return TensorDataset(noise, real)
