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

``--interleaved`` measures the modes of each implementation in one set of rank processes instead, one model per
mode, their steps taken in turn (eager, whole, block, eager, ...): all modes then see the same moments of the
machine's load, the least noisy comparison on a shared machine (times only: dynamo's counters are per process).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
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
                counts = ""
                if mode != "eager":
                    s = stats[(impl, mode)] = ranks[0]["compile"]
                    counts = (f", {s['graph_breaks']} breaks, {s['frames_skipped']} frames eager, {s['graphs']} "
                              f"graphs, {s['timed_recompiles']} timed recompiles")
                print(f"[repeat {repeat + 1}/{args.repeats}] {impl:<6} {mode:<6} {times[(impl, mode)][-1] * 1e3:8.1f} "
                      f"ms, CPU {cpu[(impl, mode)][-1] * 1e3:7.1f} ms  (load {load:.1f}){counts}", flush=True)
    return times, cpu, stats, loads


def _interleaved_rank(rank: int, world_size: int, port: int, impl: str, specs: dict, repeats: int, queue) -> None:
    """One rank of an interleaved run: a model per mode, steps taken in turn; puts its median times per mode."""
    import torch
    import torch.distributed as dist

    from .gpt import batch, build_gpt
    from .implementations import IMPLEMENTATIONS, set_compile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    spec = next(iter(specs.values()))
    torch.set_num_threads(spec.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    runs = {}
    for mode, mode_spec in specs.items():
        set_compile(mode_spec.compile, mode_spec.compile_mode)
        model = build_gpt(mode_spec.model)
        if mode == "block":
            for block in model.blocks:
                block.compile(backend=mode_spec.compile)
        runs[mode] = IMPLEMENTATIONS[impl](model, mode_spec)
    wall = {mode: [] for mode in specs}
    cpu = {mode: [] for mode in specs}
    for step in range(spec.warmup + spec.steps * repeats):
        for mode in _rotated(list(specs), step):
            start, cpu_start = time.perf_counter(), time.process_time()
            runs[mode].forward_backward(batch(spec.model, rank, step))
            runs[mode].step()
            if step >= spec.warmup:
                wall[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - cpu_start)
    queue.put((rank, {mode: (wall[mode], cpu[mode]) for mode in specs}))
    dist.destroy_process_group()


def _interleaved(args, specs: dict) -> tuple[dict, dict]:
    """Every implementation's modes in one set of ranks; per-repeat medians of rank 0 (repeats = chunks of
    ``--steps`` consecutive steps)."""
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    context = multiprocessing.get_context("spawn")
    for impl in args.impls:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        queue = context.Queue()
        procs = [context.Process(target=_interleaved_rank, args=(r, args.world_size, port, impl, specs,
                                                                  args.repeats, queue)) for r in range(args.world_size)]
        load = os.getloadavg()[0]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=args.timeout) for _ in procs)
        for proc in procs:
            proc.join()
        for mode, (wall, cpu_times) in results[0].items():
            chunks = range(0, len(wall), args.steps)
            times[(impl, mode)] = [statistics.median(wall[i:i + args.steps]) for i in chunks]
            cpu[(impl, mode)] = [statistics.median(cpu_times[i:i + args.steps]) for i in chunks]
            print(f"{impl:<6} {mode:<6} {statistics.median(wall) * 1e3:8.1f} ms, CPU "
                  f"{statistics.median(cpu_times) * 1e3:7.1f} ms  (load at start {load:.1f})", flush=True)
    return times, cpu


def _rows(args, times: dict, cpu: dict, extra, n_extra: int) -> list[str]:
    """One row per (implementation, mode): step and CPU medians, then compiled/eager ratios and the ``n_extra``
    columns of ``extra(key)`` (all blank for eager runs)."""
    rows = []
    for impl in args.impls:
        for mode in args.modes:
            key, eager = (impl, mode), (impl, "eager")
            row = (f"| {impl} | {mode} | {statistics.median(times[key]) * 1e3:.1f} | "
                   f"{statistics.median(cpu[key]) * 1e3:.1f} |")
            if mode == "eager":
                rows.append(row + " |" * (2 + n_extra))
                continue
            cells = [_ratios(times[key], times[eager]), _ratios(cpu[key], cpu[eager]), *extra(key)]
            rows.append(row + "".join(f" {c} |" for c in cells))
    return rows


def _interleaved_table(args, times: dict, cpu: dict) -> list[str]:
    return ["| implementation | mode | step ms | CPU ms | compiled / eager, step | compiled / eager, CPU |",
            "| --- | --- | --- | --- | --- | --- |"] + _rows(args, times, cpu, lambda key: [], 0)


def _ratios(mine: list[float], eager: list[float]) -> str:
    ratios = [c / e for c, e in zip(mine, eager)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _table(args, times: dict, cpu: dict, stats: dict) -> list[str]:
    def counts(key):
        s = stats[key]
        return [s["graph_breaks"], s["frames_skipped"], s["graphs"], s["timed_recompiles"]]

    return ["| implementation | mode | step ms | CPU ms | compiled / eager, step | compiled / eager, CPU "
            "| graph breaks | frames run eagerly | graphs | timed recompiles |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + _rows(args, times, cpu, counts, 4)


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
    p.add_argument("--interleaved", action="store_true",
                   help="all modes of an implementation in one set of ranks, steps in turn (times only)")
    args = p.parse_args(argv)
    if "eager" not in args.modes:
        args.modes = ["eager", *args.modes]  # every ratio needs its eager run
    base = RunSpec(model=GPTConfig(), steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                   zero_config={"stage3_param_persistence_threshold": 0})
    specs = {mode: base if mode == "eager" else replace(base, compile=args.backend, compile_mode=mode)
             for mode in args.modes}
    if args.interleaved:
        loads = [os.getloadavg()[0]]
        times, cpu = _interleaved(args, specs)
        loads.append(os.getloadavg()[0])
        print(f"\nGPT {GPTConfig()}, {args.world_size} ranks (gloo, CPU), backend {args.backend}, modes interleaved "
              f"step by step in one set of ranks, {args.repeats} chunks of {args.steps} steps after {args.warmup}; "
              f"medians of rank 0; load average {min(loads):.1f}-{max(loads):.1f}")
        print("\n".join(_interleaved_table(args, times, cpu)))
        print("\n".join(_versus(args, times, cpu, "zero3", "fsdp2")))
        return
    with tempfile.TemporaryDirectory(prefix="zero-compiled-") as tmp:
        workdir = Path(tmp)
        for mode, spec in specs.items():
            (workdir / f"{mode}.json").write_text(spec.to_json())
        times, cpu, stats, loads = _measure(args, workdir)
    print(f"\nGPT {GPTConfig()}, {args.world_size} ranks (gloo, CPU), backend {args.backend}, {args.steps} timed "
          f"steps after {args.warmup}; medians of rank 0; {args.repeats} repeats; load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    print("\n".join(_table(args, times, cpu, stats)))
    print("\n".join(_versus(args, times, cpu, "zero3", "fsdp2")))


if __name__ == "__main__":
    main()
