"""Why the offloaded host step is slower than FSDP2's (issue 19): torch's fused CPU AdamW over the same fp32
elements, stepped as FSDP2 steps it (one call over whole parameters) and as the engine does (8M-element chunks),
with and without the write-back's host -> GPU copies of the updated values running beside it.

    python -m benchmarks.gpu_host_step --numel 1.75e9
    python -m benchmarks.gpu_host_step --deepspeed --numel 2e7 2e8 --threads 16 1   # issue 38's host-step target

Variants, each timed over ``--repeats`` steps after one warm-up, on the same tensors:
- ``whole``: one ``_fused_adamw_`` call over ``--tensors`` equal tensors (FSDP2's step);
- ``chunks``: one call per 8M-element chunk (the engine's chunked step, without its copies);
- ``chunks+copies``: each chunk's updated values copied to the GPU as fp32 (pinned, asynchronous, on a copy
  stream) and cast to bf16 there, from a second thread, while the next chunks step (the engine's write-back);
- ``whole+copies``: the same copies of every element, issued all at once at the start of a whole step (what
  the copies cost the kernel when they overlap it entirely).

``--deepspeed`` (issue 38: "host step within 1.2x of DeepSpeed's compiled CPU Adam on the same host, threads and
tensor sizes") needs no GPU: one AdamW step (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01) over one flat
fp32 tensor of each ``--numel``, best of ``--repeats`` after one warm-up step that also creates the state (the
three take turns), by
- ``ours``: the engine's offloaded host step, ``chunked_adam_step`` (zero_core/offload/chunked_step.py) in the
  chunks ``OptimizerOffload`` uses on device 'cpu' where copies surround the step (``chunk_numel`` of the size),
  without the gradient copies and the write-back themselves;
- ``bare chunks`` (a diagnosis, not a contender): torch's fused AdamW called once per chunk of ``ours`` on slices
  of the same tensors, nothing else; ``ours`` minus this is the Python around the kernel calls, this minus
  ``torch fused`` what the kernel pays per call;
- ``torch fused``: torch's fused AdamW in one call over the whole tensor (FSDP2's ``CPUOffloadPolicy`` step);
- ``deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam(adamw_mode=True)`` (its AVX kernel, JIT-built by DeepSpeed's
  ``CPUAdamBuilder`` on first use; the build is timed and printed apart), or one line saying why it is missing.
Each ``--threads`` value runs in a child process started with ``OMP_NUM_THREADS`` set (torch's OpenMP runtime
and the one DeepSpeed's extension links may be two, and both read it at start), and ``torch.set_num_threads``.
The ratio column is ours / DeepSpeed's: the target is <= 1.2. ``chunks`` is how many chunks ``ours`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
import time

import torch

CHUNK = 8 << 20


def _adamw(params, grads, avgs, sqs, steps) -> None:
    torch._fused_adamw_(params, grads, avgs, sqs, [], steps, amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)


def _best(runs: dict, repeats: int) -> dict:
    """Seconds of the fastest of ``repeats`` calls of each of ``runs`` after one warm-up call each, the calls
    taking turns (a load that comes and goes then falls on all of them)."""
    times = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def _deepspeed_adam() -> tuple:
    """(DeepSpeedCPUAdam class, seconds its op took to load or build) or (None, one line saying why not)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as error:  # noqa: BLE001 - any import failure means: no DeepSpeed here
        return None, f"deepspeed not importable ({type(error).__name__}: {error})"
    start = time.perf_counter()
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # noqa: BLE001 - a failed JIT build is reported, the other steps still run
        return None, f"DeepSpeed's cpu_adam did not build ({type(error).__name__}: {str(error)[-300:]})"
    return DeepSpeedCPUAdam, time.perf_counter() - start


def _tensors(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero parameter and a gradient of values in [-1, 1] (on all threads: randn took seconds on one)."""
    return torch.zeros(numel), torch.linspace(-1.0, 1.0, numel)


def compare_at(numels: list[int], repeats: int) -> dict:
    """One step of each implementation at each size, at this process's thread count (the child's part)."""
    from zero_core.offload.chunked_step import CHUNK_MAX, _cuts, chunk_numel, chunked_adam_step

    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    threads = torch.get_num_threads()
    deepspeed_adam, build = _deepspeed_adam()
    rows = []
    for numel in numels:
        param, grad = _tensors(numel)
        weight = torch.nn.Parameter(param)
        optimizer = torch.optim.AdamW([weight], fused=True, **hyper)
        weight.grad = grad
        optimizer.step()  # creates the state; chunked_adam_step steps only pieces that have it
        state = optimizer.state[weight]
        chunk = chunk_numel(numel, CHUNK_MAX)  # as OptimizerOffload._step_chunked, where copies surround the step
        cuts = _cuts([0], [numel], chunk)
        tensors = [weight.detach(), grad, state["exp_avg"], state["exp_avg_sq"]]

        def bare() -> None:
            for lo, hi in zip(cuts, cuts[1:]):
                _adamw(*([t[lo:hi]] for t in tensors), [state["step"]])

        runs = {"ours": lambda: chunked_adam_step(optimizer, [weight], [grad], [], [], None, None, chunk),
                "torch fused": lambda: _adamw(*([t] for t in tensors), [state["step"]]),
                "bare chunks": bare}
        if deepspeed_adam is not None:  # the same values stepped, its own state
            theirs = torch.nn.Parameter(param)
            theirs.grad = grad
            runs["deepspeed"] = deepspeed_adam([theirs], adamw_mode=True, **hyper).step
        row = {"numel": numel, "chunks": len(cuts) - 1, **_best(runs, repeats)}
        del runs, optimizer, state, weight, param, grad, tensors, bare
        rows.append(row)
    return {"threads": threads, "deepspeed": build, "rows": rows}


def compare(numels: list[int], thread_counts: list[int], repeats: int, timeout: int) -> None:
    """``compare_at`` in one child process per thread count, then one table."""
    results = []
    for threads in thread_counts:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "benchmarks.gpu_host_step", "--deepspeed", "--child", str(threads),
               "--repeats", str(repeats), "--numel", *map(str, numels)]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{threads} threads: timed out after {timeout} s")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{threads} threads: exited {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
            continue
        results.append(json.loads(lines[-1][7:]))
    print(f"{os.cpu_count()} cores; one AdamW step over one fp32 tensor, best of {repeats} after one")
    for result in results:
        build = result["deepspeed"]
        print(f"{result['threads']} threads: " + (f"DeepSpeed's cpu_adam loaded in {build:.1f} s"
                                                   if isinstance(build, float) else build))
    print("| threads | elements | chunks | ours ms | torch fused ms | bare chunks ms | DeepSpeedCPUAdam ms "
          "| ours / DeepSpeed | ours / torch fused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for result in results:
        for row in result["rows"]:
            theirs = row.get("deepspeed")
            cells = [f"{row[name] * 1e3:.1f}" for name in ("ours", "torch fused", "bare chunks")]
            cells += [f"{theirs * 1e3:.1f}", f"{row['ours'] / theirs:.2f}"] if theirs else ["-", "-"]
            cells.append(f"{row['ours'] / row['torch fused']:.2f}")
            print(f"| {result['threads']} | {row['numel'] / 1e6:g}M | {row['chunks']} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_host_step", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, nargs="+", default=None,
                   help="elements (default 1.75e9; with --deepspeed: 2e7 2e8, several allowed)")
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default 2; with --deepspeed: 5)")
    p.add_argument("--deepspeed", action="store_true", help="ours, torch's fused AdamW and DeepSpeedCPUAdam")
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count(), 1], help="with --deepspeed")
    p.add_argument("--timeout", type=int, default=60, help="seconds per thread count, with --deepspeed")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.deepspeed:
        numels = [int(n) for n in (args.numel or [2e7, 2e8])]
        repeats = args.repeats or 5
        if args.child is not None:
            torch.set_num_threads(args.child)
            print("RESULT " + json.dumps(compare_at(numels, repeats)), flush=True)
        else:
            compare(numels, args.threads, repeats, args.timeout)
        return
    if args.numel is not None and len(args.numel) != 1:
        p.error("--numel takes one value without --deepspeed")
    args.numel = args.numel[0] if args.numel else 1.75e9
    args.repeats = args.repeats or 2
    numel = int(args.numel) // args.tensors * args.tensors
    size = numel // args.tensors
    t0 = time.perf_counter()
    flat = {name: torch.empty(numel, pin_memory=name in ("param", "grad")) for name in ("param", "grad", "m", "v")}
    for tensor in flat.values():
        tensor.normal_() if tensor is flat["grad"] else tensor.zero_()
    steps = [torch.tensor(1.0) for _ in range(args.tensors)]
    split = {name: list(t.split(size)) for name, t in flat.items()}
    device = torch.device("cuda", 0)
    shard = torch.empty(numel, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device)
    pool = ThreadPoolExecutor(max_workers=1)  # the engine's write-back thread
    print(f"{torch.cuda.get_device_name(0)}, {torch.get_num_threads()} threads; {numel / 1e9:.2f}B fp32 elements "
          f"in {args.tensors} tensors; setup {time.perf_counter() - t0:.0f} s")

    def copy(lo: int, hi: int) -> None:  # the engine's write-back of elements [lo, hi)
        with torch.cuda.stream(stream):
            for start in range(lo, hi, 1 << 24):
                end = min(hi, start + (1 << 24))
                shard[start:end].copy_(flat["param"][start:end].to(device, non_blocking=True))

    def whole(copies: bool) -> None:
        if copies:
            copy(0, numel)
        _adamw(split["param"], split["grad"], split["m"], split["v"], steps)

    def chunks(copies: bool) -> None:
        pending = []
        for lo in range(0, numel, CHUNK):
            hi = min(numel, lo + CHUNK)
            view = {name: [t[lo:hi]] for name, t in flat.items()}
            _adamw(view["param"], view["grad"], view["m"], view["v"], steps[:1])
            if copies:
                pending.append(pool.submit(copy, lo, hi))
        for future in pending:
            future.result()

    variants = {"whole": lambda: whole(False), "chunks": lambda: chunks(False),
                "chunks+copies": lambda: chunks(True), "whole+copies": lambda: whole(True)}
    times = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):
        for name, run in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if repeat:
                times[name].append(time.perf_counter() - start)
    print("| variant | step s (median) | G elements/s |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {numel / median / 1e9:.2f} |")


if __name__ == "__main__":
    main()
