"""Where a stage-3 step's time goes on one GPU: ``torch.profiler`` over a few steps of one implementation of
``benchmarks.gpu`` (after warm-up), the top operators by host (self CPU) time and by GPU time, the host
synchronisations counted, and a Chrome trace (gzip) to open in Perfetto.

    python -m benchmarks.gpu_profile --preset 873M --impl zero3 --out /tmp/prof
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from .gpt import batch
from .gpu import PRESETS, build

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="873M", choices=sorted(PRESETS))
    p.add_argument("--impl", default="zero3")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="prof")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    config = PRESETS[args.preset]
    forward_backward, step, keep = build(args.impl, config, False)
    data = [tuple(t.cuda() for t in batch(config, 0, s)) for s in range(args.warmup + args.steps)]
    for tokens, targets in data[: args.warmup]:
        forward_backward(tokens, targets)
        step()
    torch.cuda.synchronize()
    host = {"forward+backward": 0.0, "step": 0.0}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for tokens, targets in data[args.warmup:]:
            t0 = time.perf_counter()
            forward_backward(tokens, targets)
            t1 = time.perf_counter()
            step()
            t2 = time.perf_counter()
            host["forward+backward"] += t1 - t0
            host["step"] += t2 - t1
        torch.cuda.synchronize()
    averages = prof.key_averages()
    stem = os.path.join(args.out, f"{args.impl}_{args.preset}")
    with open(stem + ".txt", "w") as f:
        f.write(f"{args.impl}, {args.preset}, {args.steps} profiled steps; host time per step (s): "
                + ", ".join(f"{k} {v / args.steps:.4f}" for k, v in host.items()) + "\n\n")
        for op in SYNC_OPS:
            count = sum(e.count for e in averages if e.key == op)
            f.write(f"{op}: {count / args.steps:.1f} per step\n")
        f.write("\nby self CPU time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        f.write("\nby device time\n" + averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    trace = stem + ".json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    print(open(stem + ".txt").read()[:4000])
    del keep
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
