"""Models that touch their children's weights in their own ``__init__`` (so, under ``zero_core.Init``, after the
children were partitioned), for tests/stage3/test_stage3_init_safety.py.

``Toucher(case)`` runs one of ``TOUCHES`` (a write or read through an index, a view, ``.data``, an ``nn.init``
function, ``torch.save``…) at the end of its ``__init__``. The clients are the real ways models initialise
themselves: Hugging Face ``LlamaForCausalLM`` (tied embeddings, ``pad_token_id=0``) and ``GPT2LMHeadModel`` built
from tiny configs, a nanoGPT-style model (``self.apply(self._init_weights)``), and a model that calls its children's
``reset_parameters()``. Every client takes ``(seed)`` and its forward takes ``models.transformer_batch``.
"""

from __future__ import annotations

import io
import math

import torch
import torch.nn.functional as F
from torch import nn

from models import SEQ, VOCAB

# Every public initialiser of torch.nn.init (the test checks this list against the module).
INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                  "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_INIT_ARGS = {"constant_": (0.3,), "sparse_": (0.5,)}


def _init_target(model: "Toucher", name: str, on_view: bool) -> torch.Tensor:
    """A tensor of a shape ``name`` accepts: a parameter, or a view of one."""
    if name == "dirac_":
        return model.conv.weight[1:] if on_view else model.conv.weight
    if name == "eye_":
        return model.lin.weight[:3] if on_view else model.lin.weight
    return model.emb.weight[2:7] if on_view else model.emb.weight


def _apply_init(name: str, on_view: bool):
    def touch(model: "Toucher") -> None:
        getattr(nn.init, name)(_init_target(model, name, on_view), *_INIT_ARGS.get(name, ()))
    return touch


def _unbind(m) -> None:
    rows = m.lin.weight.unbind()
    rows[0].add_(rows[1])  # reads another view of the same parameter


def _kept_view(m) -> None:
    row = m.emb.weight[9]
    m.extra = nn.Linear(2, 2)  # another submodule attached (and partitioned) while the view is held
    row.copy_(torch.arange(6.0))
    m.kept = row  # still held when construction ends


def _save_roundtrip(m) -> None:
    buffer = io.BytesIO()
    torch.save(m.emb.weight, buffer)
    buffer.seek(0)
    m.probe.copy_(torch.load(buffer, weights_only=True)[6])


def _numpy_read(m) -> None:
    m.probe.copy_(torch.tensor(m.emb.weight.numpy()[4]))


def _setitem(m) -> None:
    m.lin.weight[1] = 3.0


def _iadd(m) -> None:
    m.lin.bias += 1


def _view_setitem(m) -> None:
    m.lin.weight.view(-1)[3] = -2.0


def _split(m) -> None:
    for part in m.emb.weight.split(10):
        part[0].fill_(9.0)


def _assign_same_shape(m) -> None:
    m.lin.weight.data = torch.full((5, 6), 0.25)


def _assign_new_shape(m) -> None:
    m.lin.bias.data = F.pad(m.lin.bias.data, (0, 2))  # as Hugging Face pads a tied head's bias


# name -> what the parent's __init__ does (under torch.no_grad()) once its children exist.
TOUCHES = {
    "index zero_": lambda m: m.emb.weight[5].zero_(),
    "setitem": _setitem,
    "slice fill_": lambda m: m.emb.weight[2:4].fill_(0.5),
    ".data row normal_": lambda m: m.emb.weight.data[7].normal_(),
    ".data uniform_": lambda m: m.lin.weight.data.uniform_(-0.1, 0.1),
    "detach add_": lambda m: m.lin.bias.detach().add_(1.0),
    "view setitem": _view_setitem,
    "reshape mul_": lambda m: m.emb.weight.reshape(-1)[:4].mul_(3.0),
    "t mul_": lambda m: m.lin.weight.t()[0].mul_(0.5),
    "T zero_": lambda m: m.lin.weight.T[1].zero_(),
    "narrow fill_": lambda m: m.emb.weight.narrow(1, 2, 2).fill_(1.0),
    "split": _split,
    "chunk zero_": lambda m: m.lin.weight.chunk(2, dim=1)[1].zero_(),
    "unbind": _unbind,
    "as_strided fill_": lambda m: m.emb.weight.as_strided((3,), (7,)).fill_(4.0),
    "kept view": _kept_view,
    "copy_ into": lambda m: m.lin.weight.copy_(torch.ones(5, 6)),
    "copy_ out": lambda m: m.probe.copy_(m.emb.weight[3]),
    "numpy read": _numpy_read,
    "iadd": _iadd,
    "two parameters": lambda m: m.emb.weight[1].copy_(m.lin.weight[0]),
    "torch.save": _save_roundtrip,
    ".data = same shape": _assign_same_shape,
    ".data = new shape": _assign_new_shape,
    "repr": lambda m: m.probe.fill_(float(len(repr(m.emb.weight)) > 0)),
    **{f"init.{n}": _apply_init(n, False) for n in INIT_FUNCTIONS},
    **{f"init.{n} on a view": _apply_init(n, True) for n in INIT_FUNCTIONS},
}


class Toucher(nn.Module):
    """Three children, then ``TOUCHES[case]`` on their weights; a buffer ``probe`` receives what is read."""

    def __init__(self, case: str):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.lin = nn.Linear(6, 5)
        self.conv = nn.Conv1d(2, 3, 3)
        self.register_buffer("probe", torch.zeros(6))
        with torch.no_grad():
            TOUCHES[case](self)


# -- real clients ------------------------------------------------------------------------------------------------
def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM from a tiny config; the loss of ``models.transformer_batch`` in fp32."""

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if kind == "llama":
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
                                 pad_token_id=0, tie_word_embeddings=True)
            self.lm = _seeded(seed, lambda: LlamaForCausalLM(config))
        else:
            config = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=2, n_head=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.lm = _seeded(seed, lambda: GPT2LMHeadModel(config))

    def forward(self, tokens, targets):
        logits = self.lm(input_ids=tokens, use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class LlamaLM(HFCausalLM):
    def __init__(self, seed: int = 0):
        super().__init__("llama", seed)


class GPT2LM(HFCausalLM):
    def __init__(self, seed: int = 0):
        super().__init__("gpt2", seed)


class NanoBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 2 * width)
        self.c_proj = nn.Linear(2 * width, width)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.attn_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's construction: tied head, ``self.apply(self._init_weights)``, then scaled residual projections."""

    def __init__(self, seed: int = 0, width: int = 16, depth: int = 2):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.wte = nn.Embedding(VOCAB, width)
            self.wpe = nn.Embedding(SEQ, width)
            self.h = nn.ModuleList([NanoBlock(width) for _ in range(depth)])
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, VOCAB, bias=False)
            self.wte.weight = self.lm_head.weight
            self.apply(self._init_weights)
            for name, param in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class ResetLM(nn.Module):
    """Calls its children's ``reset_parameters()`` in its own ``__init__``; the embedding has a padding index, so
    its reset writes a row through a view (``weight[padding_idx].fill_(0)``)."""

    def __init__(self, seed: int = 0, width: int = 12):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.emb = nn.Embedding(VOCAB, width, padding_idx=0)
            self.inp = nn.Linear(width, width)
            self.norm = nn.LayerNorm(width)
            self.out = nn.Linear(width, VOCAB)
            for child in self.children():
                child.reset_parameters()

    def forward(self, tokens, targets):
        logits = self.out(self.norm(F.gelu(self.inp(self.emb(tokens)))))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


CLIENTS = {"llama": LlamaLM, "gpt2": GPT2LM, "nanogpt": NanoGPT, "reset_parameters": ResetLM}
