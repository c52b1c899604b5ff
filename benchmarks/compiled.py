"""torch.compile side by side: every implementation eager and compiled on the harness's GPT, in one run.

    python -m benchmarks.compiled --world-size 2 --repeats 2 --backend inductor

Each (repeat, implementation, mode) is a fresh set of rank processes (benchmarks/worker.py with
``RunSpec.compile``), interleaved so the machine's noise falls on all alike. Reports the median step time of
rank 0 (best repeat), compiled / eager per implementation, and from the compiled run its graph breaks, graphs
and the frames compiled during the timed steps (recompilations; 0 is the goal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .gpt import GPTConfig
from .run import launch
from .worker import RunSpec

IMPLS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--timeout", type=float, default=1200.0)
    args = p.parse_args(argv)
    base = RunSpec(model=GPTConfig(), steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                   zero_config={"stage3_param_persistence_threshold": 0})
    times: dict[tuple[str, str], list[float]] = {}
    stats: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="zero-compiled-") as tmp:
        workdir = Path(tmp)
        for mode, backend in (("eager", ""), ("compiled", args.backend)):
            (workdir / f"{mode}.json").write_text(replace(base, compile=backend).to_json())
        for repeat in range(args.repeats):
            for impl in args.impls[repeat % len(args.impls):] + args.impls[: repeat % len(args.impls)]:
                for mode in ("eager", "compiled"):
                    ranks = launch(impl, workdir / f"{mode}.json", args.world_size, sys.executable, args.timeout,
                                   workdir)
                    if any(r.get("status") != "ok" for r in ranks):
                        bad = next(r for r in ranks if r.get("status") != "ok")
                        raise SystemExit(f"{impl} {mode} failed:\n{bad.get('reason', '')[-3000:]}")
                    times.setdefault((impl, mode), []).append(statistics.median(ranks[0]["times"]))
                    if mode == "compiled":
                        stats[impl] = ranks[0]["compile"]
                    print(f"[repeat {repeat + 1}/{args.repeats}] {impl:<6} {mode:<8} "
                          f"{min(times[(impl, mode)]) * 1e3:8.1f} ms", flush=True)
    print(f"\nGPT {GPTConfig()}, {args.world_size} ranks (gloo, CPU), backend {args.backend}; median step of rank 0, "
          f"best of {args.repeats} repeats")
    print("| implementation | eager ms | compiled ms | compiled / eager | graph breaks | graphs | timed recompiles |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for impl in args.impls:
        eager, compiled = min(times[(impl, "eager")]), min(times[(impl, "compiled")])
        s = stats[impl]
        print(f"| {impl} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | {compiled / eager:.2f} | {s['graph_breaks']} | "
              f"{s['graphs']} | {s['timed_recompiles']} |")


if __name__ == "__main__":
    main()
