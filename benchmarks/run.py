"""The benchmark: every implementation side by side on one GPT model, data and seed, in one run.

    python -m benchmarks.run --world-size 2 --steps 20 --repeats 3
    python -m benchmarks.run --world-size 2 4 --deepspeed-python /path/to/venv/bin/python

Each (world size, repeat, implementation) is a fresh set of rank processes (see benchmarks/worker.py), run
one after another; the order of implementations rotates with every repeat, so the machine's noise falls on
all of them alike. Raw results go to benchmarks/results/latest.json; docs/benchmarks.md and its plots are
written from them (``--report-only`` rewrites the docs from the saved results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .gpt import GPTConfig
from .implementations import IMPLEMENTATIONS
from .worker import RunSpec

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_IMPLS = ["ddp", "torch_zero", "fsdp2", "zero1", "zero2", "zero3"]
DEEPSPEED_IMPLS = ["deepspeed1", "deepspeed2", "deepspeed3"]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "latest.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, nargs="+", default=[2], help="rank counts to run (e.g. 2 4)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed, uncounted steps first")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every implementation")
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"implementations (default {' '.join(DEFAULT_IMPLS)}, plus DeepSpeed's with --deepspeed-python)")
    p.add_argument("--deepspeed-python", default=None,
                   help="a python with deepspeed installed (a venv made with --system-site-packages); "
                   "adds deepspeed1-3, run with DS_ACCELERATOR=cpu")
    for name, default in asdict(GPTConfig()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"model: {name}")
    p.add_argument("--bucket-numel", type=int, default=RunSpec.bucket_numel,
                   help="bucket size in elements for every implementation that has buckets")
    p.add_argument("--no-overlap-comm", dest="overlap_comm", action="store_false",
                   help="turn off overlap_comm for lightning-zero and DeepSpeed")
    p.add_argument("--zero-config", type=json.loads, default={},
                   help="JSON object merged into lightning-zero's config, e.g. '{\"reduce_scatter\": false}'")
    p.add_argument("--fsdp-no-reshard", dest="fsdp_reshard", action="store_false",
                   help="FSDP2 with reshard_after_forward=False (ZeRO-2-like communication)")
    p.add_argument("--lr", type=float, default=RunSpec.lr)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before one run's ranks are killed")
    p.add_argument("--results", default=None,
                   help=f"raw results JSON (default {DEFAULT_RESULTS.relative_to(ROOT)}; with --no-docs, none)")
    p.add_argument("--docs", default=str(ROOT / "docs"), help="where benchmarks.md and img/ are written")
    p.add_argument("--no-docs", action="store_true", help="print the table only; leave docs/ alone")
    p.add_argument("--report-only", action="store_true", help="rewrite the docs from --results; run nothing")
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    impls = args.impls or DEFAULT_IMPLS + (DEEPSPEED_IMPLS if args.deepspeed_python else [])
    unknown = [i for i in impls if i not in IMPLEMENTATIONS]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPLEMENTATIONS)}")
    if any(i.startswith("deepspeed") for i in impls) and not args.deepspeed_python:
        raise SystemExit("DeepSpeed runs need --deepspeed-python PATH (a python that can import deepspeed)")
    if "ddp" not in impls:
        raise SystemExit("ddp must be among --impls: every ratio and loss is compared with it")
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    if min(args.world_size) < 1 or args.warmup < 0:
        raise SystemExit("--world-size must be >= 1 and --warmup >= 0")
    return impls


def make_spec(args: argparse.Namespace, world_size: int) -> RunSpec:
    model = GPTConfig(**{name: getattr(args, name) for name in asdict(GPTConfig())})
    threads = args.threads or max(1, (os.cpu_count() or 1) // world_size)
    return RunSpec(model=model, steps=args.steps, warmup=args.warmup, lr=args.lr, bucket_numel=args.bucket_numel,
                   overlap_comm=args.overlap_comm, fsdp_reshard_after_forward=args.fsdp_reshard,
                   zero_config=args.zero_config, threads=threads, timeout_s=args.timeout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(impl: str, spec_path: Path, world_size: int, python: str, timeout: float, workdir: Path) -> list[dict]:
    """Start every rank of one run, wait for all (killing them at the timeout), return their results."""
    port, procs = _free_port(), []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        if impl.startswith("deepspeed"):
            env["DS_ACCELERATOR"] = "cpu"
        out, log = workdir / f"{impl}.{rank}.json", workdir / f"{impl}.{rank}.log"
        for stale in (out, log):
            stale.unlink(missing_ok=True)
        cmd = [python, "-m", "benchmarks.worker", "--spec", str(spec_path), "--impl", impl, "--out", str(out)]
        with open(log, "w") as log_file:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    other.kill()
                    other.wait()
    return [_read_rank(workdir, impl, rank, timeout) for rank in range(world_size)]


def _read_rank(workdir: Path, impl: str, rank: int, timeout: float) -> dict:
    out = workdir / f"{impl}.{rank}.json"
    if out.exists():
        return json.loads(out.read_text())
    tail = (workdir / f"{impl}.{rank}.log").read_text()[-3000:]
    return {"status": "error", "impl": impl, "rank": rank,
            "reason": f"no result (killed after {timeout:g} s, or crashed); log tail:\n{tail}"}


def run_all(args: argparse.Namespace, impls: list[str]) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="zero-bench-") as tmp:
        workdir = Path(tmp)
        for world_size in args.world_size:
            spec = make_spec(args, world_size)
            spec_path = workdir / f"spec{world_size}.json"
            spec_path.write_text(spec.to_json())
            for repeat in range(args.repeats):
                shift = repeat % len(impls)
                for impl in impls[shift:] + impls[:shift]:
                    python = args.deepspeed_python if impl.startswith("deepspeed") else sys.executable
                    started = time.monotonic()
                    ranks = launch(impl, spec_path, world_size, python, args.timeout, workdir)
                    status = ",".join(sorted({r.get("status", "?") for r in ranks}))
                    print(f"[N={world_size} repeat {repeat + 1}/{args.repeats}] {impl:<11} {status:<11} "
                          f"{time.monotonic() - started:6.1f} s", flush=True)
                    runs.append({"impl": impl, "world_size": world_size, "repeat": repeat, "ranks": ranks})
    return {"command": command_line(), "machine": machine(args), "args": vars(args), "impls": impls,
            "specs": {str(n): json.loads(make_spec(args, n).to_json()) for n in args.world_size}, "runs": runs}


def command_line() -> str:
    return "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def machine(args: argparse.Namespace) -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "cpu": _cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": _commit()}
    if args.deepspeed_python:
        probe = subprocess.run([args.deepspeed_python, "-c", "import deepspeed; print(deepspeed.__version__)"],
                               capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        info["deepspeed"] = probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 else "not importable"
    return info


def _commit() -> str:
    """The checked-out commit, marked '+ local changes' when zero_core/ differs from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + local changes in zero_core/" if git("status", "--porcelain", "--", "zero_core") else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from .report import summarize, write_docs, format_console

    results_path = Path(args.results) if args.results else None if args.no_docs else DEFAULT_RESULTS
    if args.report_only:
        results = json.loads((results_path or DEFAULT_RESULTS).read_text())
    else:
        impls = check_args(args)
        results = run_all(args, impls)
        if results_path is not None:
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1))
    summary = summarize(results)
    print(format_console(summary))
    if not args.no_docs:
        path = write_docs(results, summary, Path(args.docs))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
