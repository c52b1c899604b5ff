"""Issue 38: is torch's fused CPU AdamW slower on a second thread than on the training thread, and why? The
overlapped offloaded step (zero_core/offload/overlapped_step.py) runs the host step on a thread while the training
thread runs the next forward; at 6.58B on an H200 it measured as if the host step ran 1.6x slower there.

    python -m benchmarks.step_on_thread                  # 1e9 elements on a GPU machine, 5e7 elsewhere
    python -m benchmarks.step_on_thread --numel 2e7 --chunks 1e6 4e6

One step over ``--numel`` fp32 elements (parameter, gradient, two moments), in chunks of ``--chunks`` elements (one
``torch._fused_adamw_`` call each, as the engine's chunked step), median of ``--repeats`` after one warm-up, the
variants taking turns:
- ``main``: on this thread, at torch's thread count;
- ``worker (T-1)`` / ``worker (T)``: on a second thread whose torch count is one less than / equal to this one's
  (the engine uses one less), this thread waiting for it asleep;
- ``... + spin``: this thread busy meanwhile, as the training thread is in a CUDA synchronise (a GPU sleep kernel
  and ``torch.cuda.synchronize()``, which spins on its core), or, without a GPU, in a Python busy loop;
- ``... + launch``: this thread launching small kernels in a Python loop meanwhile, as a forward does (it takes
  the GIL back between its ops; the worker needs the GIL between its chunks).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.gpu_host_step import _adamw  # one AdamW step of torch's fused CPU kernel


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_on_thread", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=1e9 if cuda else 5e7)
    p.add_argument("--chunks", type=float, nargs="+", default=[8 << 20, 32 << 20])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    numel = int(args.numel)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    flat = {name: torch.zeros(numel) for name in ("param", "m", "v")}
    flat["grad"] = torch.linspace(-1.0, 1.0, numel)
    step = [torch.tensor(1.0)]
    device = torch.device("cuda", 0) if cuda else None
    small = torch.randn(256, 256, device=device) if cuda else torch.randn(64, 64)
    print(f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, {threads} torch threads; {numel / 1e6:g}M fp32 "
          f"elements; setup {time.perf_counter() - t0:.1f} s")

    def run(chunk: int) -> None:
        for lo in range(0, numel, chunk):
            hi = min(numel, lo + chunk)
            view = {name: [t[lo:hi]] for name, t in flat.items()}
            _adamw(view["param"], view["grad"], view["m"], view["v"], step)

    def spin(done: threading.Event) -> None:  # the training thread in a CUDA synchronise
        while not done.is_set():
            if cuda:
                torch.cuda._sleep(1_000_000)
                torch.cuda.synchronize()
            else:
                end = time.perf_counter() + 0.001
                while time.perf_counter() < end:
                    pass

    def launch(done: threading.Event) -> None:  # the training thread in a forward: small ops, the GIL between
        out = small
        while not done.is_set():
            for _ in range(50):
                out = torch.tanh(out @ small) if cuda else torch.tanh(out)
            if cuda:
                torch.cuda.synchronize()

    pools = {}
    for count in (max(1, threads - 1), threads):
        def init(count=count) -> None:
            torch.get_num_threads()
            torch.set_num_threads(count)
        pools[count] = ThreadPoolExecutor(max_workers=1, initializer=init)
        pools[count].submit(lambda: None).result()
    torch.set_num_threads(threads)

    def on_worker(count: int, chunk: int, busy) -> None:
        done = threading.Event()
        future = pools[count].submit(run, chunk)
        future.add_done_callback(lambda _: done.set())
        if busy is not None:
            busy(done)
        future.result()

    variants = {}
    for chunk in map(int, args.chunks):
        label = f"{chunk / 2**20:g}M"
        variants[f"main, chunks {label}"] = lambda c=chunk: run(c)
        for count in sorted(pools):
            tag = f"worker ({'T-1' if count < threads else 'T'}={count}), chunks {label}"
            variants[tag] = lambda n=count, c=chunk: on_worker(n, c, None)
            variants[tag + " + spin"] = lambda n=count, c=chunk: on_worker(n, c, spin)
            variants[tag + " + launch"] = lambda n=count, c=chunk: on_worker(n, c, launch)
    times = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):
        for name, variant in variants.items():
            start = time.perf_counter()
            variant()
            if repeat:
                times[name].append(time.perf_counter() - start)
    print("| variant | step s (median) | / main at the same chunks |")
    print("| --- | --- | --- |")
    base = {}
    for name, values in times.items():
        median = statistics.median(values)
        chunks = name.rsplit("chunks ", 1)[1].split(" ")[0]
        base.setdefault(chunks, median)
        print(f"| {name} | {median:.3f} | {median / base[chunks]:.2f} |")
    for pool in pools.values():
        pool.shutdown()


if __name__ == "__main__":
    main()
