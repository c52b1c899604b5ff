"""The CPU proxy for stage 3's host-side cost: many tiny blocks at world size 1, where Python per unit dominates.

    python -m benchmarks.proxy                     # 48 blocks, 3 interleaved repeats, writes the table to stdout
    python -m benchmarks.proxy --blocks 48 --repeats 5 --json out.json
    python -m benchmarks.proxy --fused --impls plain zero1 zero2 --per-step   # per-step medians, interleaved

On a fast GPU the kernels of a block take microseconds, so what limits stage 3 there is the engine's own Python
per unit (hooks, gathers, bookkeeping). This benchmark makes that cost visible on a CPU: residual blocks of
LayerNorm + Linear 64->128->64 on a batch of 2x16, AdamW, one process (gloo, world size 1; there is no special
path for world size 1, so the per-unit work is what any world size pays). Each implementation is built fresh
on the same model, data and seed; the figure is process CPU time per step, the best of the interleaved
repeats. With ``--per-step`` every implementation is built once and they take turns in chunks of 5 steps
(``--steps`` chunks each); the figure is the median of the steps' thread CPU times. On a shared machine that is
the steadier comparison: every implementation steps in the same seconds, where the best of a few whole runs
varies by 10% from run to run. It reports the overhead per block per step against plain training and the
collectives per block and, for stage 3, per unit per step (a block holds three modules with parameters; stage 3 makes the block one unit,
stage3/block_units.py, so 48 blocks are 48 units).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

IMPLS = ("plain", "fsdp2", "zero1", "zero2", "zero3")


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class DeepNarrow(nn.Module):
    def __init__(self, blocks: int, width: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


FUSED = False  # --fused: every implementation's AdamW(fused=True) (torch's default on CPU is its per-tensor loop)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=FUSED or None)


def build(impl: str, model: nn.Module, zero_config: dict) -> tuple[Callable, Callable, object]:
    """(forward_backward(x) -> loss, step(), engine or None) for one implementation."""
    if impl in ("plain", "fsdp2"):
        if impl == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = _adamw(model.parameters())

        def forward_backward(x):
            opt.zero_grad(set_to_none=True)
            loss = model(x)
            loss.backward()
            return loss

        return forward_backward, opt.step, None
    import zero_core

    # Persistence 0: every block is a partitioned unit (the default threshold would keep these tiny blocks whole
    # and hide the per-unit cost this benchmark exists to measure).
    config = {"stage": int(impl[-1]), "stage3_param_persistence_threshold": 0, **zero_config}
    engine = zero_core.setup(model, _adamw(model.parameters()), config)

    def forward_backward(x):
        loss = engine.module(x)
        engine.backward(loss)
        return loss

    return forward_backward, engine.step, engine


def measure(impl: str, args, zero_config: dict) -> dict:
    torch.manual_seed(0)
    model = DeepNarrow(args.blocks, args.width, args.hidden)
    x = torch.randn(args.batch, args.seq, args.width, generator=torch.Generator().manual_seed(1))
    forward_backward, step, engine = build(impl, model, zero_config)
    for _ in range(args.warmup):
        forward_backward(x)
        step()
    if engine is not None:
        engine.reset_comm_stats()
    start = time.process_time()
    for _ in range(args.steps):
        loss = forward_backward(x)
        step()
    seconds = (time.process_time() - start) / args.steps
    result = {"step_s": seconds, "loss": float(loss.detach())}
    if engine is not None:
        stats = engine.comm_stats()
        result["collectives_per_step"] = {k: v["calls"] / args.steps for k, v in stats.items()}
        units = getattr(getattr(engine, "runtime", None), "units", None)
        if units is not None and int(impl[-1]) == 3:
            result["units"] = len(units)
    return result


def measure_per_step(args, zero_config: dict, chunk: int = 5) -> dict[str, dict]:
    """Every implementation built once; they take turns in chunks of ``chunk`` steps; the median step."""
    x = torch.randn(args.batch, args.seq, args.width, generator=torch.Generator().manual_seed(1))
    runs = {}
    for impl in args.impls:
        torch.manual_seed(0)
        forward_backward, step, engine = build(impl, DeepNarrow(args.blocks, args.width, args.hidden), zero_config)
        for _ in range(args.warmup):
            forward_backward(x)
            step()
        if engine is not None:
            engine.reset_comm_stats()
        runs[impl] = (forward_backward, step, engine, [])
    for _ in range(args.steps):
        for forward_backward, step, _, times in runs.values():
            for _ in range(chunk):
                start = time.thread_time()
                loss = forward_backward(x)
                step()
                times.append(time.thread_time() - start)
    results = {}
    for impl, (_, _, engine, times) in runs.items():
        results[impl] = {"step_s": statistics.median(times), "loss": float(loss.detach())}
        if engine is not None:
            results[impl]["collectives_per_step"] = {k: v["calls"] / len(times) for k, v in engine.comm_stats().items()}
            units = getattr(getattr(engine, "runtime", None), "units", None)
            if units is not None and int(impl[-1]) == 3:
                results[impl]["units"] = len(units)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--zero-config", type=json.loads, default={}, help="JSON merged into lightning-zero's config")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--per-step", action="store_true", help="build each implementation once, step them in turns of "
                   "5 steps (--steps turns each) and report the median step's thread CPU time")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) for every implementation, plain included "
                   "(without it plain runs torch's CPU default, the per-tensor loop; the stages pick fused anyway)")
    args = p.parse_args(argv)
    global FUSED
    FUSED = args.fused
    if "plain" not in args.impls:
        raise SystemExit("plain must be among --impls: the overhead is measured against it")
    torch.set_num_threads(1)  # host-side cost, not intra-op parallelism
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    best: dict[str, dict] = measure_per_step(args, args.zero_config) if args.per_step else {}
    for repeat in range(0 if args.per_step else args.repeats):
        order = args.impls[repeat % len(args.impls):] + args.impls[: repeat % len(args.impls)]  # rotate the order
        for impl in order:
            result = measure(impl, args, args.zero_config)
            if impl not in best or result["step_s"] < best[impl]["step_s"]:
                best[impl] = result
    dist.destroy_process_group()
    report(best, args)


def report(best: dict, args) -> None:
    plain = best["plain"]["step_s"]
    print(f"CPU proxy: {args.blocks} blocks of LayerNorm + Linear {args.width}->{args.hidden}->{args.width}, batch "
          f"{args.batch}x{args.seq}, AdamW{'(fused=True)' if args.fused else ''}, world size 1; "
          + (f"thread CPU time, median of {args.steps} turns of 5 steps each" if args.per_step else
             f"process CPU time per step, best of {args.repeats}") + f"; load average {os.getloadavg()[0]:.1f}")
    print("| implementation | ms per step | × plain | overhead ms per block per step | collectives per block per step "
          "| collectives per unit per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for impl, result in best.items():
        ms = result["step_s"] * 1e3
        per_block = (result["step_s"] - plain) * 1e3 / args.blocks
        calls = result.get("collectives_per_step")
        per_block_calls = ", ".join(f"{k} {v / args.blocks:.2f}" for k, v in sorted(calls.items())) if calls else "–"
        units = result.get("units")
        per_unit_calls = ", ".join(f"{k} {v / units:.3f}" for k, v in sorted(calls.items())
                                   if k != "all_reduce") + f" ({units} units)" if calls and units else "–"
        print(f"| {impl} | {ms:.1f} | {result['step_s'] / plain:.2f} | {per_block:+.3f} | {per_block_calls} "
              f"| {per_unit_calls} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": best}, f, indent=1)


if __name__ == "__main__":
    main()
