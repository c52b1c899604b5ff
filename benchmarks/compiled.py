"""torch.compile side by side: every implementation eager, whole-model compiled and per-block compiled, in one run.

    python -m benchmarks.compiled --world-size 2 --repeats 3 --backend inductor --impls fsdp2 zero3

Modes: ``eager``; ``whole`` (``torch.compile(model)`` around what the implementation returns); ``block``
(``block.compile()`` for each transformer block before the implementation wraps the model, torchtitan's recipe).
Each (repeat, implementation, mode) is a fresh set of rank processes (benchmarks/worker.py with
``RunSpec.compile``), interleaved so the machine's noise falls on all alike. For each compiled mode it reports
the median step time of rank 0 (wall clock, and process CPU time: all of the rank's threads, which a machine
shared with other jobs disturbs far less than the wall clock), the compiled / eager ratio of each repeat (eager
and compiled measured next to each other, so a ratio sees less of the machine's drift than the times do) with
its spread, and from the
compiled run: graph breaks, frames dynamo gave up on (run eagerly: a break inside a loop skips the whole frame,
which dynamo does not count as a break), graphs, and frames compiled during the timed steps (recompilations).
The load average at the start of each run is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .gpt import GPTConfig
from .run import launch
from .worker import RunSpec

IMPLS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
MODES = ("eager", "whole", "block")


def _rotated(items: list, by: int) -> list:
    return items[by % len(items):] + items[: by % len(items)]


def _measure(args, workdir: Path) -> tuple[dict, dict, dict, list]:
    """Run every (repeat, implementation, mode); returns wall and CPU step times, compile stats, load averages."""
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    stats: dict[tuple[str, str], dict] = {}
    loads = []
    for repeat in range(args.repeats):
        for impl in _rotated(list(args.impls), repeat):
            for mode in _rotated(list(args.modes), repeat):
                load = os.getloadavg()[0]
                loads.append(load)
                ranks = launch(impl, workdir / f"{mode}.json", args.world_size, sys.executable, args.timeout,
                               workdir)
                if any(r.get("status") != "ok" for r in ranks):
                    bad = next(r for r in ranks if r.get("status") != "ok")
                    raise SystemExit(f"{impl} {mode} failed:\n{bad.get('reason', '')[-3000:]}")
                times.setdefault((impl, mode), []).append(statistics.median(ranks[0]["times"]))
                cpu.setdefault((impl, mode), []).append(statistics.median(ranks[0]["cpu_times"]))
                if mode != "eager":
                    stats[(impl, mode)] = ranks[0]["compile"]
                print(f"[repeat {repeat + 1}/{args.repeats}] {impl:<6} {mode:<6} {times[(impl, mode)][-1] * 1e3:8.1f} "
                      f"ms, CPU {cpu[(impl, mode)][-1] * 1e3:7.1f} ms  (load {load:.1f})", flush=True)
    return times, cpu, stats, loads


def _ratios(mine: list[float], eager: list[float]) -> str:
    ratios = [c / e for c, e in zip(mine, eager)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _table(args, times: dict, cpu: dict, stats: dict) -> list[str]:
    lines = ["| implementation | mode | step ms | CPU ms | compiled / eager, step | compiled / eager, CPU "
             "| graph breaks | frames run eagerly | graphs | timed recompiles |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for impl in args.impls:
        for mode in args.modes:
            key, eager = (impl, mode), (impl, "eager")
            row = (f"| {impl} | {mode} | {statistics.median(times[key]) * 1e3:.1f} | "
                   f"{statistics.median(cpu[key]) * 1e3:.1f} |")
            if mode == "eager":
                lines.append(row + " | | | | | |")
                continue
            s = stats[key]
            lines.append(row + f" {_ratios(times[key], times[eager])} | {_ratios(cpu[key], cpu[eager])} | "
                         f"{s['graph_breaks']} | {s['frames_skipped']} | {s['graphs']} | {s['timed_recompiles']} |")
    return lines


def _versus(args, times: dict, cpu: dict, impl: str, other: str) -> list[str]:
    """``impl`` / ``other`` per mode, repeat by repeat (the two ran within minutes of each other)."""
    if impl not in args.impls or other not in args.impls:
        return []
    return [f"{impl} / {other}, {mode}: step {_ratios(times[(impl, mode)], times[(other, mode)])}, "
            f"CPU {_ratios(cpu[(impl, mode)], cpu[(other, mode)])} (median, min-max over {args.repeats} repeats)"
            for mode in args.modes]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    if "eager" not in args.modes:
        args.modes = ["eager", *args.modes]  # every ratio needs its eager run
    base = RunSpec(model=GPTConfig(), steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                   zero_config={"stage3_param_persistence_threshold": 0})
    with tempfile.TemporaryDirectory(prefix="zero-compiled-") as tmp:
        workdir = Path(tmp)
        for mode in args.modes:
            spec = base if mode == "eager" else replace(base, compile=args.backend, compile_mode=mode)
            (workdir / f"{mode}.json").write_text(spec.to_json())
        times, cpu, stats, loads = _measure(args, workdir)
    print(f"\nGPT {GPTConfig()}, {args.world_size} ranks (gloo, CPU), backend {args.backend}, {args.steps} timed "
          f"steps after {args.warmup}; medians of rank 0; {args.repeats} repeats; load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print("\n".join(_table(args, times, cpu, stats)))
    print("\n".join(_versus(args, times, cpu, "zero3", "fsdp2")))


if __name__ == "__main__":
    main()
