"""qwZ's loss effect without the engine: benchmarks/nodes.py's training replayed in one process.

    python -m benchmarks.qwz_replay --steps 200

The 2 x 2 ranks' batches are concatenated (the same mean gradient), the weights are bf16 copies of fp32 AdamW
masters, and the forward sees every module's weights round-tripped as stage 3 with qwZ sends them: each unit's
flat buffer cut into 4 rank shards, each shard quantised in blocks (zero_core/comm/quantize.py); the backward
computes with the exact bf16 weights (qwZ quantises the forward gather only). Training runs without quantising,
with symmetric codes and with asymmetric ones; then the unquantised run's final model is evaluated with one
module family's weights round-tripped at a time (symmetric codes), which shows where a loss gap comes from.
"""

from __future__ import annotations

import argparse

import torch

from zero_core.comm import quantize as q

from .gpt import batch, build_gpt
from .nodes import NODES, PER_NODE, SMALL

WORLD = NODES * PER_NODE


def round_trip(flat: torch.Tensor, asymmetric: bool) -> torch.Tensor:
    """``flat`` (one unit's parameters, concatenated) as the gathered forward copy would hold it."""
    numel = flat.numel()
    shards = torch.nn.functional.pad(flat.float(), (0, -numel % WORLD)).view(WORLD, -1)
    back = [q.dequantize(q.quantize(s.view(1, -1), 8, asymmetric=asymmetric), 8, s.numel()) for s in shards]
    return torch.cat(back, dim=1).view(-1)[:numel].to(flat.dtype)


def units(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """Stage 3's units: each module's own parameters (a tied weight with its first owner)."""
    seen, out = set(), []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            out.append((name, own))
    return out


def set_weights(model, masters: dict, codes: str | None, only: str = "") -> None:
    """bf16 copies of the masters; units whose module name contains ``only`` round-tripped through ``codes``."""
    for name, params in units(model):
        values = [masters[id(p)].detach().to(torch.bfloat16) for p in params]
        if codes is not None and only in name:
            flat = round_trip(torch.cat([v.reshape(-1) for v in values]), codes == "asymmetric")
            values = list(flat.split([v.numel() for v in values]))
        for param, value in zip(params, values):
            param.data = value.view(param.shape).clone()


def mean_loss(model, steps) -> float:
    with torch.no_grad():
        return sum(model(*joined(step)).item() for step in steps) / len(steps)


def joined(step: int):
    pieces = [batch(SMALL, rank, step) for rank in range(WORLD)]
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def train(steps: int, codes: str | None):
    model = build_gpt(SMALL)
    masters = {id(p): torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()}
    optimizer = torch.optim.AdamW(masters.values(), lr=1e-3)
    losses = []
    for step in range(steps):
        set_weights(model, masters, codes)
        loss = model(*joined(step))
        set_weights_in_place(model, masters)  # the backward's gather: exact 16-bit weights
        loss.backward()
        for p in model.parameters():
            masters[id(p)].grad = p.grad.float()
            p.grad = None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, masters, sum(losses[-10:]) / min(10, steps)


def set_weights_in_place(model, masters: dict) -> None:
    """Refill the forward's weights with exact values without a new tensor (autograd saved the old ones)."""
    for p in model.parameters():
        p.data.copy_(masters[id(p)].detach().to(p.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.qwz_replay", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"training {args.steps} steps; final loss = mean of the last 10 (forward as qwZ sends the weights)")
    base = None
    for codes in (None, "symmetric", "asymmetric"):
        model, masters, final = train(args.steps, codes)
        base = base if base is not None else (final, model, masters)
        print(f"  {codes or 'unquantised':12s} {final:.4f}  {100 * (final / base[0] - 1):+.2f}%", flush=True)
    _, model, masters = base
    held_out = list(range(args.steps, args.steps + 20))
    set_weights(model, masters, None)
    exact = mean_loss(model, held_out)
    print("the unquantised run's model on 20 further batches, with one family round-tripped (symmetric codes):")
    for only in ("ln_f", "blocks", "tok", ""):
        set_weights(model, masters, "symmetric", only)
        print(f"  {only or 'everything':12s} {100 * (mean_loss(model, held_out) / exact - 1):+.2f}%", flush=True)


if __name__ == "__main__":
    main()
