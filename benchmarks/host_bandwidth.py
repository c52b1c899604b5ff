"""Is the offloaded host step bound by the host's memory bandwidth? (issue 38)

The step started during backward (``offload_optimizer.overlap_with_backward``) runs the host's Adam kernel while
backward's gradients stream into host memory; the inline step runs it after they landed. If the kernel is bound by
memory bandwidth, the copies' bytes slow it by their share of that bandwidth, and no ordering of the work can hide
them. This measures it on the machine at hand:

    python -m benchmarks.host_bandwidth                  # 1e9 elements with a GPU, 5e7 without
    python -m benchmarks.host_bandwidth --numel 2e8 --threads 16 15

For each ``--threads`` count (``torch.set_num_threads`` in this process), median of ``--repeats`` after a warm-up:
- ``a += b``: an in-place add over fp32 tensors of ``--numel`` elements (reads both, writes one: 12 bytes per
  element; a copy would also read its destination before writing it);
- ``AdamW``: torch's fused CPU AdamW (what the offloaded step runs) over one fp32 tensor of ``--numel`` elements:
  it reads parameter, gradient and both moments and writes three of them back, 28 bytes per element;
- with a GPU, ``AdamW beside GPU->host`` / ``beside host->GPU``: the same step while asynchronous copies between
  the GPU and pinned host memory run for all of it (the gradients' copies during backward / the write-back), with
  the copies' own rate.
GB/s is bytes moved / time; ``of a += b`` is that as a share of the add's rate at the same thread count: near 1,
the kernel is bound by memory bandwidth as the add is.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Callable, Optional

import torch

from benchmarks.gpu_host_step import _adamw  # one AdamW step of torch's fused CPU kernel

_COPY_NUMEL = 1 << 28  # elements per copy beside the step (1 GiB of fp32)


def _median_seconds(run: Callable[[], None], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _beside_copies(step: Callable[[], None], seconds: float, to_gpu: bool, repeats: int) -> tuple[float, float]:
    """(median seconds of ``step`` while copies in one direction run for all of it, the copies' GB/s)."""
    gpu = torch.empty(_COPY_NUMEL, device="cuda")
    host = torch.empty(_COPY_NUMEL, pin_memory=True)
    stream = torch.cuda.Stream()
    count = math.ceil(seconds * 60e9 / (4 * _COPY_NUMEL)) + 2  # more than the step lasts, at PCIe 5's rate
    times, rates = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            for _ in range(count):
                (gpu.copy_(host, non_blocking=True) if to_gpu else host.copy_(gpu, non_blocking=True))
            end.record()
        time.sleep(0.01)  # the copies under way
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        end.synchronize()
        rates.append(count * 4 * _COPY_NUMEL / (begin.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(times), statistics.median(rates)


def measure(numel: int, threads: int, repeats: int) -> list[tuple[str, float, float, Optional[float]]]:
    """Rows (name, seconds, GB/s, copies' GB/s or None) at ``threads`` torch threads."""
    torch.set_num_threads(threads)
    param, grad = torch.ones(numel), torch.full((numel,), 1e-3)
    add_s = _median_seconds(lambda: param.add_(grad), repeats)
    avg, sq, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())

    def adamw() -> None:
        _adamw([param], [grad], [avg], [sq], [step])

    adamw_s = _median_seconds(adamw, repeats)
    rows = [("a += b", add_s, 12 * numel / add_s / 1e9, None), ("AdamW", adamw_s, 28 * numel / adamw_s / 1e9, None)]
    if torch.cuda.is_available():
        for name, to_gpu in (("AdamW beside GPU->host", False), ("AdamW beside host->GPU", True)):
            seconds, rate = _beside_copies(adamw, adamw_s, to_gpu, repeats)
            rows.append((name, seconds, 28 * numel / seconds / 1e9, rate))
    return rows


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=1e9 if cuda else 5e7)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: the CPU count and one less")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    cpus = os.cpu_count() or 1
    counts = args.threads or sorted({cpus, max(1, cpus - 1)}, reverse=True)
    numel = int(args.numel)
    print(f"{torch.cuda.get_device_name(0) if cuda else 'CPU only'}; {cpus} CPUs; {numel:.3g} fp32 elements; "
          f"median of {args.repeats} after one")
    print("| threads | run | seconds | GB/s | of a += b | copies beside, GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads in counts:
        rows = measure(numel, threads, args.repeats)
        add_rate = rows[0][2]
        for name, seconds, rate, beside in rows:
            print(f"| {threads} | {name} | {seconds:.3f} | {rate:.1f} | {rate / add_rate:.2f} | "
                  f"{'-' if beside is None else format(beside, '.1f')} |", flush=True)


if __name__ == "__main__":
    main()
