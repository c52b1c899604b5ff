"""Why the offloaded host step is slower than FSDP2's (issue 19): torch's fused CPU AdamW over the same fp32
elements, stepped as FSDP2 steps it (one call over whole parameters) and as the engine does (8M-element chunks),
with and without the write-back's host -> GPU copies of the updated values running beside it.

    python -m benchmarks.gpu_host_step --numel 1.75e9

Variants, each timed over ``--repeats`` steps after one warm-up, on the same tensors:
- ``whole``: one ``_fused_adamw_`` call over ``--tensors`` equal tensors (FSDP2's step);
- ``chunks``: one call per 8M-element chunk (the engine's chunked step, without its copies);
- ``chunks+copies``: each chunk's updated values copied to the GPU as fp32 (pinned, asynchronous, on a copy
  stream) and cast to bf16 there, from a second thread, while the next chunks step (the engine's write-back);
- ``whole+copies``: the same copies of every element, issued all at once at the start of a whole step (what
  the copies cost the kernel when they overlap it entirely).
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
import time

import torch

CHUNK = 8 << 20


def _adamw(params, grads, avgs, sqs, steps) -> None:
    torch._fused_adamw_(params, grads, avgs, sqs, [], steps, amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.999,
                        weight_decay=0.01, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_host_step", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=1.75e9)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
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
