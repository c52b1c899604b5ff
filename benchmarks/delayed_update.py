"""The offloaded step overlapped with the accelerator's work, measured on a CPU (issue 38).

    python -m benchmarks.delayed_update overlap              # stand-in: step time against sum and max
    python -m benchmarks.delayed_update overlap --stage 3    # ... with the exact step overlapped, unit by unit
    python -m benchmarks.delayed_update overlap --backward   # stage 2, each bucket's step started in backward
    python -m benchmarks.delayed_update loss --steps 300     # loss curve: delayed update against the exact step

``overlap``: a CPU stand-in for one GPU. The model's forward and backward are a sleep of a set length (a GPU
frees the host's cores while it computes) plus the host work a real backward leaves (gradients written,
reduced into buckets); its parameters (``--numel`` fp32 elements) are offloaded (``offload_optimizer: cpu``,
stage 2, world size 1), so the optimizer step is a real host step of that size. Two engines, the exact step and
``delayed_update_after`` (the host step of step t on a thread while step t+1's forward and backward run), take
turns (a shared machine's load then falls on both), with a third that overlaps the exact step with the next
forward (``overlap_with_forward``, forced on: it acts only beside an accelerator); with ``--stage 3`` each of
``--tensors`` blocks is a unit, the sleep is split over their forwards and backwards, and a fourth engine also
starts each unit's step during backward (``overlap_with_backward``); with ``--backward`` at stage 2 a fourth
engine starts each bucket's step during backward (every engine then has a reduce bucket per block). Each
reports the median time per iteration, its forward+backward, its step call and the host step inside it, against
the sum and the max of (everything else, host step) of the exact engine. ``--fb-ms`` sets the sleep; by default
it equals the exact host step, measured first.

``loss``: a small GPT (benchmarks/gpt.py) trained at world size 1 with the exact step and with the delayed
update after each ``--after`` warm-up, on the same batches; the loss per window of steps, the steps each run
takes to reach a few losses, and the largest gap.
Results go to stdout and, with ``--out``, to a markdown file (benchmarks/results/delayed_update_*.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import zero_core
from benchmarks.gpt import GPTConfig, batch, build_gpt


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a block's share of the accelerator's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class SleepingBlock(nn.Module):
    """One parameter of ``size`` elements (a stage-3 unit of its own); its forward and its backward each sleep
    ``seconds`` (its share of the accelerator's time) and its backward writes one gradient element per element."""

    def __init__(self, size: int, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((size,), 0.01))
        self.seconds = seconds

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return _SleepInBackward.apply((self.weight * scale).sum(), self.seconds)


class SleepingModel(nn.Module):
    """``tensors`` blocks of ``numel`` elements in all; forward and backward together sleep ``fb_s`` (the
    accelerator's time), half in each, spread over the blocks (so at stage 3 a unit's forward waits for its
    update and the later units' sleeps run meanwhile)."""

    def __init__(self, numel: int, tensors: int, fb_s: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SleepingBlock(numel // tensors, fb_s / (2 * tensors)) for _ in range(tensors))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum(block(scale) for block in self.blocks)


def _engine(model: nn.Module, lr: float, config: dict):
    return zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=lr), config)


def _config(delayed: bool, after: int = 2, dtype: torch.dtype = torch.float32, stage: int = 2,
            backward: bool = False, bucket: int = 50_000_000) -> dict:
    block = {"device": "cpu", "overlap_with_backward": backward}
    if delayed:
        block["delayed_update_after"] = after
    return {"stage": stage, "offload_optimizer": block, "reduce_bucket_size": bucket,
            "param_persistence_threshold": 0, "bf16": {"enabled": dtype == torch.bfloat16}}


class StandIn:
    """One engine of the stand-in, timed: per iteration, the whole, its forward+backward, its step call, and the
    host step inside that call (the offloaded masters' step: in a delayed run, what the training thread spends
    on it)."""

    def __init__(self, args, fb_s: float, delayed: bool, overlapped: bool = False, backward: bool = False) -> None:
        self.dtype = args.dtype
        # --backward at stage 2: a reduce bucket per block, so that backward reduces them one by one
        bucket = args.numel // args.tensors if args.backward and args.stage == 2 else 50_000_000
        self.engine = _engine(SleepingModel(args.numel, args.tensors, fb_s), 1e-3,
                              _config(delayed, dtype=args.dtype, stage=args.stage, backward=backward, bucket=bucket))
        # the overlapped step acts only beside an accelerator: forced here (or off)
        self.engine._offload.overlap = overlapped
        self.times: dict[str, list[float]] = {"iteration": [], "fb": [], "step": [], "host": []}
        self.index = 0
        masters = self.engine._masters
        masters_step = masters.step

        def timed_step(*a, **k):
            start = time.perf_counter()
            masters_step(*a, **k)
            self._host = time.perf_counter() - start

        masters.step = timed_step

    def run(self, iterations: int, keep_from: int) -> None:
        """``iterations`` iterations, keeping the times from the ``keep_from``-th on (the first ones of a turn
        have no update in flight yet); then the update in flight lands, so the next engine's turn runs alone."""
        for index in range(iterations):
            self.index += 1
            scale = torch.tensor(1.0 + 0.01 * self.index, dtype=self.dtype)
            start = time.perf_counter()
            self.engine.backward(self.engine.module(scale))
            middle = time.perf_counter()
            self.engine.step()
            end = time.perf_counter()
            if index >= keep_from:
                for name, value in (("iteration", end - start), ("fb", middle - start), ("step", end - middle),
                                    ("host", self._host)):
                    self.times[name].append(value)
        with self.engine.offload_resident():
            pass

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}


def bench_overlap(args) -> str:
    sections = []
    for dtype in args.dtypes:
        args.dtype = getattr(torch, dtype)
        sections.append(bench_overlap_dtype(args))
    return "\n\n".join(sections)


def bench_overlap_dtype(args) -> str:
    ms = lambda s: f"{1000 * s:.1f}"  # noqa: E731
    probe = StandIn(args, 0.0, False)  # the inline step (the overlap acts only beside an accelerator)
    probe.run(args.turn, 1)
    fb_s = probe.medians()["host"] if args.fb_ms is None else args.fb_ms / 1000
    probe.engine.close()
    del probe
    runs = {"exact step": StandIn(args, fb_s, False)}
    # The exact step overlapped with the next forward (overlapped_step.py): unit by unit at stage 3; at stage 2 the
    # step call's all-gather of the flat group waits for all of it (why overlap_with_forward: null is stage 3 only)
    runs["overlapped exact step"] = StandIn(args, fb_s, False, overlapped=True)
    if args.stage == 3 or args.backward:  # each unit's / bucket's step started during backward
        runs["exact step started during backward"] = StandIn(args, fb_s, False, overlapped=True, backward=True)
    runs["delayed update"] = StandIn(args, fb_s, True)
    for turn in range(args.turns):  # the two take turns, so that both see the same load on a shared machine
        for run in (runs.values() if turn % 2 == 0 else reversed(list(runs.values()))):
            run.run(args.turn, 2)
    results = {name: run.medians() for name, run in runs.items()}
    for run in runs.values():
        run.engine.close()
    exact = results["exact step"]
    host, rest = exact["host"], exact["iteration"] - exact["host"]
    kept = args.turns * (args.turn - 2)
    lines = [f"CPU stand-in: {args.numel / 1e6:g}M parameters ({args.dtype}) in {args.tensors} tensors, "
             f"stage {args.stage}, "
             f"world size 1 (gloo), offload_optimizer cpu, torch threads {torch.get_num_threads()}; the "
             f"accelerator's forward+backward = a sleep of {ms(fb_s)} ms (the exact host step, measured first), "
             f"plus the host's own gradient work. The exact and the delayed engine take {args.turns} turns of "
             f"{args.turn} iterations; medians of {kept} iterations each (the first two of each turn left out).", "",
             f"Exact step: host step (the offloaded masters' step) H = {ms(host)} ms; everything else in the "
             f"iteration D = {ms(rest)} ms (the sleep, gradients written, the gloo reduce-scatter and all-gather, "
             f"bookkeeping); sum D + H = {ms(host + rest)} ms, max = {ms(max(host, rest))} ms.", "",
             "| run | iteration (ms) | forward+backward (ms) | step call (ms) | host step on the training thread (ms) "
             "| iteration / max | iteration / sum |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {ms(r['iteration'])} | {ms(r['fb'])} | {ms(r['step'])} | {ms(r['host'])} | "
                     f"{r['iteration'] / max(host, rest):.2f} | {r['iteration'] / (host + rest):.2f} |")
    return "\n".join(lines)


def train_gpt(config: GPTConfig, steps: int, lr: float, delayed: bool, after: int) -> list[float]:
    engine = _engine(build_gpt(config), lr, _config(delayed, after))
    losses = []
    for step in range(steps):
        loss = engine.module(*batch(config, 0, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def _steps_to_reach(losses: list[float], target: float, span: int = 10) -> str:
    """The first step at which the mean loss of the last ``span`` steps is at most ``target``."""
    for end in range(span, len(losses) + 1):
        if statistics.mean(losses[end - span:end]) <= target:
            return str(end - 1)
    return "not reached"


def bench_loss(args) -> str:
    config = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_layer=args.layers, n_head=4, seq_len=32,
                       batch_size=8)
    runs = [("exact", train_gpt(config, args.steps, args.lr, False, 0))]
    runs += [(f"delayed after {after}", train_gpt(config, args.steps, args.lr, True, after)) for after in args.after]
    window = args.window
    exact = runs[0][1]
    lines = [f"Small GPT (vocab {config.vocab}, d_model {config.d_model}, {config.n_layer} layers, seq "
             f"{config.seq_len}, batch {config.batch_size}), AdamW lr {args.lr}, stage 2, world size 1, "
             f"offload_optimizer cpu; the exact step and delayed_update_after "
             f"{', '.join(map(str, args.after))}; same batches. Mean loss per window of {window} steps.", "",
             "| steps | " + " | ".join(name for name, _ in runs) + " |", "| --- |" + " --- |" * len(runs)]
    for start in range(0, args.steps, window):
        means = [statistics.mean(losses[start:start + window]) for _, losses in runs]
        lines.append(f"| {start}-{min(args.steps, start + window) - 1} | "
                     + " | ".join(f"{m:.4f}" for m in means) + " |")
    lines += ["", "Steps until the mean loss of the last 10 steps is at most the target:", "",
              "| target | " + " | ".join(name for name, _ in runs) + " |", "| --- |" + " --- |" * len(runs)]
    for target in args.targets:
        lines.append(f"| {target:g} | " + " | ".join(_steps_to_reach(losses, target) for _, losses in runs) + " |")
    for name, losses in runs[1:]:
        gap = max(abs(a - b) for a, b in zip(exact, losses))
        lines.append(f"\n{name}: largest gap to the exact step at one step {gap:.4f}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.delayed_update", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    overlap = sub.add_parser("overlap", help="CPU stand-in: step time against sum and max")
    overlap.add_argument("--numel", type=int, default=16_000_000)
    overlap.add_argument("--tensors", type=int, default=8)
    overlap.add_argument("--fb-ms", type=float, default=None, help="the sleep; default: the exact host step")
    overlap.add_argument("--turns", type=int, default=6)
    overlap.add_argument("--turn", type=int, default=6, help="iterations per turn (at least 3)")
    overlap.add_argument("--stage", type=int, choices=(2, 3), default=2,
                         help="3: also the exact step overlapped with the next forward, each block a unit")
    overlap.add_argument("--backward", action="store_true",
                         help="at stage 2: also each bucket's step started during backward (a bucket per block)")
    overlap.add_argument("--dtypes", choices=("float32", "bfloat16"), nargs="+", default=["float32", "bfloat16"])
    loss = sub.add_parser("loss", help="loss curve: delayed update against the exact step")
    loss.add_argument("--steps", type=int, default=300)
    loss.add_argument("--after", type=int, nargs="+", default=[10, 50])
    loss.add_argument("--targets", type=float, nargs="+", default=[3.0, 1.0, 0.1, 0.05])
    loss.add_argument("--lr", type=float, default=3e-3)
    loss.add_argument("--window", type=int, default=50)
    loss.add_argument("--vocab", type=int, default=512)
    loss.add_argument("--d-model", type=int, default=64)
    loss.add_argument("--layers", type=int, default=2)
    for p in (overlap, loss):
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
        p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        text = bench_overlap(args) if args.command == "overlap" else bench_loss(args)
    finally:
        dist.destroy_process_group()
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(f"# `python -m benchmarks.delayed_update {' '.join(argv or __import__('sys').argv[1:])}`\n\n"
                      f"{text}\n")


if __name__ == "__main__":
    main()
