"""Train a small GPT on generated addition problems with the ZeRO core API, on CPU processes.

    torchrun --nproc-per-node 2 examples/core_train.py
    torchrun --nproc-per-node 2 examples/core_train.py --stage 1 --precision bf16 --steps 200
    torchrun --nproc-per-node 2 examples/core_train.py --config my_deepspeed_config.json
    torchrun --nproc-per-node 2 examples/core_train.py --stage 3 --compile inductor

The corpus is generated at run time ("12+34=046;" repeated), so nothing is downloaded. Each rank reads
its own problems; rank 0 prints the loss averaged over ranks, then the share of answer digits predicted.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_core

ALPHABET = "0123456789+=;"
CHAR_ID = {c: i for i, c in enumerate(ALPHABET)}
PROBLEM_LEN = len("12+34=046;")
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), help="ZeRO stage (default 2)")
    parser.add_argument("--precision", choices=tuple(PRECISIONS), help="parameter dtype (default fp32)")
    parser.add_argument("--config", help="a DeepSpeed-style JSON/YAML config, instead of --stage/--precision")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 turns clipping off")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", metavar="BACKEND",
                        help="torch.compile the model after setup with this backend (inductor, aot_eager)")
    args = parser.parse_args()
    if args.config and (args.stage or args.precision):
        parser.error("give either --config or --stage/--precision: the config file sets both")
    return args


def zero_config(args: argparse.Namespace):
    """What zero_core.setup accepts: a path, or a dict of zero_optimization keys plus fp16/bf16."""
    if args.config:
        return args.config
    return {"stage": args.stage or 2, **PRECISIONS[args.precision or "fp32"]}


# -- data ------------------------------------------------------------------------------------------------
def addition_text(generator: torch.Generator, problems: int) -> str:
    a, b = torch.randint(0, 100, (2, problems), generator=generator).tolist()
    return "".join(f"{x:02d}+{y:02d}={x + y:03d};" for x, y in zip(a, b))


def make_batch(rank: int, step: int, batch_size: int, context: int):
    """Inputs and next-character targets; a different stream for every (rank, step)."""
    generator = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    problems = math.ceil((context + 1) / PROBLEM_LEN) + 1
    rows = []
    for _ in range(batch_size):
        text = addition_text(generator, problems)
        start = int(torch.randint(0, PROBLEM_LEN, (1,), generator=generator))
        rows.append([CHAR_ID[c] for c in text[start : start + context + 1]])
    tokens = torch.tensor(rows)
    return tokens[:, :-1], tokens[:, 1:]


# -- model -----------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, an LM head tied to the token embedding."""

    def __init__(self, vocab: int, context: int = 48, width: int = 96, layers: int = 3, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).float()  # the loss is computed in fp32 whatever the model's dtype


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """Weight decay on matrices only, the usual GPT recipe: two parameter groups."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def warmup_cosine(steps: int):
    warmup = max(1, steps // 10)
    return lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


# -- training --------------------------------------------------------------------------------------------
def mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


@torch.no_grad()
def answer_accuracy(model: nn.Module, rank: int, context: int) -> float:
    """Share of answer digits (after '=') that the model predicts right, on problems it never saw."""
    inputs, targets = make_batch(rank, 10**6, 64, context)
    predicted = model(inputs).argmax(-1)
    after_equals = torch.zeros_like(inputs, dtype=torch.bool)
    for offset in range(3):  # the three answer digits follow '=' (the input at a position predicts the next)
        after_equals[:, offset:] |= inputs[:, : inputs.shape[1] - offset] == CHAR_ID["="]
    after_equals &= targets != CHAR_ID[";"]
    return (predicted == targets)[after_equals].float().mean().item()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # same initial weights everywhere (the engine also broadcasts rank 0's)
    model = TinyGPT(len(ALPHABET))
    context = model.pos.num_embeddings
    optimizer = make_optimizer(model, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.steps))
    engine = zero_core.setup(model, optimizer, zero_config(args))  # the one line a plain PyTorch loop adds
    run = torch.compile(model, backend=args.compile) if args.compile else model  # any stage (docs/stage3.md)
    fp16 = engine.loss_scaler is not None
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{params:,} parameters on {world} ranks; model dtype {next(model.parameters()).dtype}")

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = make_batch(rank, step, args.batch_size, context)
        loss = F.cross_entropy(run(inputs).flatten(0, 1), targets.flatten())
        if fp16:
            engine.backward(loss)  # applies the fp16 loss scale; loss.backward() would skip it
        else:
            loss.backward()
        # The global norm over every shard; torch.nn.utils.clip_grad_norm_ would see no (sharded) gradients.
        norm = engine.clip_grad_norm_(args.clip) if args.clip > 0 else None
        optimizer.step()  # the user's optimizer: the engine's sharded step
        scheduler.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == args.steps:
            mean_loss = mean_over_ranks(loss.item())
            if rank == 0:
                norm_text = f"  grad norm {norm.item():.3f}" if norm is not None else ""
                print(f"step {step:4d}  loss {mean_loss:.4f}{norm_text}  lr {optimizer.param_groups[0]['lr']:.2e}"
                      f"  loss scale {engine.loss_scale:g}  {time.perf_counter() - started:.0f} s", flush=True)

    accuracy = mean_over_ranks(answer_accuracy(model, rank, context))
    memory = engine.memory_stats()
    engine.close()  # nothing left in flight when the process group is destroyed
    if rank == 0:
        print(f"answer digits right: {accuracy:.1%}; skipped steps: {engine.skipped_steps}")
        print("model-state bytes on rank 0: " + ", ".join(f"{k} {v:,}" for k, v in memory.items()))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo")
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
