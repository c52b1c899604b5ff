"""Helpers shared by the stage 3 tests: runs that read weights the stage 3 way, models with stage 3's hard cases.

Stage 3 parameters are partitioned, so weights are read with `zero_core.GatheredParameters` (a collective),
never directly. The models here are importable by name (spawned ranks import them) and take the batches of
`models.mlp_batch` (13 inputs, 7 targets) or `models.transformer_batch`.
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_core
from distributed import run_distributed
from models import MLP_SIZES, OddMLP, TinyTransformer, mlp_batch, transformer_batch
from reference import LR, EngineDriver, Result, make_optimizer, make_scheduler, train_loop

N_IN, N_OUT = MLP_SIZES[0], MLP_SIZES[-1]


# -- reading and comparing weights ---------------------------------------------------------------------------
def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of every parameter, whole (a collective under stage 3; plain models pass through)."""
    with zero_core.GatheredParameters(list(model.parameters())):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


def capture(fn, *args, **kwargs) -> dict:
    """Run one section; its result, or its traceback (so one broken feature does not hide the others)."""
    try:
        return {"ok": fn(*args, **kwargs)}
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        return {"error": traceback.format_exc()}


_RUNS: dict = {}


def run_once(worker, world_size: int, timeout: float) -> list:
    """`run_distributed(worker, world_size)` once per test session; the tests reading its sections share it,
    and a failed run (a hang turned into TimeoutError, a crash) fails each of them without running again."""
    key = (worker.__module__, worker.__qualname__, world_size)
    if key not in _RUNS:
        try:
            _RUNS[key] = run_distributed(worker, world_size, timeout=timeout)
        except Exception as error:  # noqa: BLE001 - kept and reported by every test that reads this run
            _RUNS[key] = error
    if isinstance(_RUNS[key], Exception):
        raise AssertionError(f"the shared {world_size}-rank run failed: {_RUNS[key]}")
    return _RUNS[key]


def unwrap(section: dict):
    if "error" in section:
        raise AssertionError(f"the section raised on a rank:\n{section['error']}")
    return section["ok"]


# -- training runs -------------------------------------------------------------------------------------------
def rank_batches(data_fn):
    rank = dist.get_rank()
    return lambda step, micro: data_fn(rank, step, micro)


def train_engine(model_fn, data_fn, config, steps, accumulation=1, clip=None, no_sync=True,
                 optimizer_fn=make_optimizer):
    """`reference.train_zero` for any stage: the weights are read gathered. Returns (Result, engine)."""
    model = model_fn()
    optimizer = optimizer_fn(model, LR)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    losses, norms = train_loop(EngineDriver(engine), scheduler, rank_batches(data_fn), steps, accumulation, clip,
                               no_sync)
    lrs = [group["lr"] for group in engine.optimizer.param_groups]
    return Result(full_params(model), losses, norms, lrs), engine


# -- models with stage 3's hard cases ------------------------------------------------------------------------
class TransposedLinear(nn.Module):
    """Uses another module's weight, transposed, in its own forward: an external parameter it must register."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self._source = (source,)  # a tuple, so the source is not a submodule of this one
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, source.in_features))

    def forward(self, x):
        return F.linear(x, self._source[0].weight.t(), self.bias)


class ExternalParamMLP(nn.Module):
    """13 -> 29 -> 13 (decoder = encoder's weight transposed, registered external) -> 7."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.encode = nn.Linear(N_IN, 29)
            self.decode = TransposedLinear(self.encode)
            self.out = nn.Linear(N_IN, N_OUT)
        zero_core.register_external_parameter(self.decode, self.encode.weight)

    def forward(self, x, y):
        h = self.decode(torch.tanh(self.encode(x)))
        return F.mse_loss(self.out(torch.tanh(h)), y)


class SkipBiasLinear(nn.Linear):
    """Returns ``(x @ W^T, bias)``; the caller adds the bias (Megatron's skip_bias_add)."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class BiasReturningMLP(nn.Module):
    """13 -> 29 -> 17 (its bias returned and added outside) -> 7."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(N_IN, 29)
            self.mid = SkipBiasLinear(29, 17)
            self.out = nn.Linear(17, N_OUT)

    def forward(self, x, y):
        h, bias = self.mid(F.gelu(self.inp(x)))
        return F.mse_loss(self.out(F.gelu(h + bias)), y)


class RecurrentMLP(nn.Module):
    """13 -> 19, then the same 19 -> 19 cell three times per forward, -> 7."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(N_IN, 19)
            self.cell = nn.Linear(19, 19)
            self.out = nn.Linear(19, N_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = h + torch.tanh(self.cell(h))
        return F.mse_loss(self.out(h), y)


class CheckpointedTransformer(TinyTransformer):
    """TinyTransformer whose blocks run under non-reentrant activation checkpointing."""

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class WideMLP(nn.Module):
    """`depth` layers of odd width; every parameter is used by exactly one module, all trainable."""

    def __init__(self, seed: int = 0, depth: int = 4, width: int = 23):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(N_IN, width)
            self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
            self.out = nn.Linear(width, N_OUT)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.out(h), y)


class RoutedMLP(nn.Module):
    """Three square layers applied in the order ``route`` (a code path chosen per call), then a head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList([nn.Linear(N_IN, N_IN) for _ in range(3)])
            self.out = nn.Linear(N_IN, N_OUT)

    def forward(self, x, y, route=(0, 1, 2)):
        for index in route:
            x = torch.tanh(self.layers[index](x))
        return F.mse_loss(self.out(x), y)


def route_of(step: int) -> tuple:
    """Every rank switches code path together: one order for steps 0-3, another for 4-6, then back."""
    return (2, 0, 1) if 4 <= step <= 6 else (0, 1, 2)


def routed_batch(rank, step, micro, dtype=torch.float32):
    return (*mlp_batch(rank, step, micro, dtype), route_of(step))


# name -> (model class, batch function): every class takes a seed and returns the loss from its forward.
MODELS = {
    "transformer": (TinyTransformer, transformer_batch),
    "mlp": (OddMLP, mlp_batch),
    "external": (ExternalParamMLP, mlp_batch),
    "bias_returning": (BiasReturningMLP, mlp_batch),
    "recurrent": (RecurrentMLP, mlp_batch),
    "checkpointed": (CheckpointedTransformer, transformer_batch),
    "routed": (RoutedMLP, routed_batch),
    "wide": (WideMLP, mlp_batch),
}


def build(name: str, seed: int = 0) -> nn.Module:
    return MODELS[name][0](seed)


def batch(name: str, rank: int, step: int, micro: int, dtype=torch.float32):
    return MODELS[name][1](rank, step, micro, dtype)


# -- inference helpers ---------------------------------------------------------------------------------------
@torch.no_grad()
def generate(model: TinyTransformer, tokens: torch.Tensor, new_tokens: int):
    """Greedy decoding that calls the submodules directly, many times per call; (tokens, last logits)."""
    logits = None
    for _ in range(new_tokens):
        window = tokens[:, -model.pos.num_embeddings:]
        x = model.tok(window) + model.pos(torch.arange(window.shape[1]))
        for block in model.blocks:
            x = block(x)
        logits = model.head(model.ln_f(x))[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens, logits


def group_of(param: nn.Parameter) -> int | None:
    """The optimizer group `reference.decay_groups` puts a parameter in (None: frozen)."""
    return None if not param.requires_grad else (0 if param.ndim >= 2 else 1)


def expected_units(model: nn.Module, world_size: int, threshold: int = 0, model_threshold: int = sys.maxsize):
    """The documented partitioning, recomputed: one unit per owner's (first-held) parameters of one optimizer
    group, where the owner is a block (is_block: all of its subtree) or else the module itself, and parameters
    smaller than ``threshold`` apart from the others, padded to a multiple of the world size (one bucket); such a
    unit of small parameters is persistent while the total kept stays within ``model_threshold``. Dicts: module (the owner), numel, padded, persistent."""
    owner_of, names = {}, {m: n for n, m in model.named_modules()}
    for module in model.modules():
        if module not in owner_of and is_block(model, module):
            for member in module.modules():
                owner_of.setdefault(member, module)
    owned: dict = {}
    seen = set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        owned.setdefault(names[owner_of.get(module, module)], []).extend(own)
    units, budget = [], model_threshold
    for name, own in owned.items():
        keys = [(-1 if group_of(p) is None else group_of(p), p.numel() < threshold) for p in own]
        for group, small in sorted(set(keys)):
            params = [p for p, key in zip(own, keys) if key == (group, small)]
            numel = sum(p.numel() for p in params)
            persistent = small and numel <= budget
            budget -= numel if persistent else 0
            units.append({"module": name, "numel": numel, "padded": -(-numel // world_size) * world_size,
                          "persistent": persistent, "trainable": group >= 0, "params": params})
    return units


def is_block(model: nn.Module, module: nn.Module) -> bool:
    """The documented block rule: a child of a ModuleList with parameters in more than one module of its subtree
    (stage 3 hooks it as a whole)."""
    in_list = any(isinstance(m, nn.ModuleList) and any(c is module for c in m.children()) for m in model.modules())
    holders = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    return in_list and len(holders) > 1


def module_gather_numel(model: nn.Module, module: nn.Module, world_size: int) -> int:
    """Padded elements gathered to run ``module``: the units of every parameter it holds (tied ones too), and of
    its whole subtree when it is a block."""
    held = {id(p) for p in module.parameters(recurse=is_block(model, module))}
    return sum(u["padded"] for u in expected_units(model, world_size) if any(id(p) in held for p in u["params"]))


def root_group_gather_numel(model: nn.Module, world_size: int) -> int:
    """Padded elements of the documented root group (docs/stage3.md, torch.compile): the units of the modules
    below no ModuleList element, when the model has a block; gathered once by the root's hooks, kept into the
    backward. 0 when there is no group."""
    listed = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for c in lst.children()
              for m in c.modules()}
    if not any(is_block(model, m) for m in model.modules()):
        return 0
    held = {id(p) for m in model.modules() if id(m) not in listed for p in m.parameters(recurse=False)}
    return sum(u["padded"] for u in expected_units(model, world_size) if any(id(p) in held for p in u["params"]))
