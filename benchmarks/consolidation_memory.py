"""Peak memory of offline consolidation on a model with many tensors (a measurement, not a timed test).

    python benchmarks/consolidation_memory.py [--tensors 1200] [--largest-mb 32] [--shard-mb 64]

1. Two gloo ranks train a synthetic model (many small and mid-size tensors, one large embedding) one AdamW
   step under ZeRO stage 2 and save a sharded checkpoint.
2. A fresh process consolidates it to bf16 and fp32 while a thread samples its anonymous resident memory
   (RssAnon: what the process allocated, not the page cache of the memory-mapped input files).
3. The table compares the peak above the process's baseline with the bound the design promises: about the
   largest tensor (fp32, plus its converted copy) plus one output shard, far below the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not in /proc/self/status (Linux only)")


def build_model(tensors: int, largest_mb: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = nn.ModuleList()
    layers.append(nn.Embedding(largest_mb * MB // (4 * 1024), 1024))  # the largest tensor
    for index in range((tensors - 1) // 2):  # weight + bias each; sizes cycle so shards fill unevenly
        width = (64, 256, 512, 1024)[index % 4]
        layers.append(nn.Linear(width, 256))
    return layers


def save_worker(rank: int, world_size: int, port: int, path: str, tensors: int, largest_mb: int) -> None:
    import torch
    import torch.distributed as dist

    import zero_core
    from zero_core.checkpoint import save_checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = build_model(tensors, largest_mb)
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": 2})
    loss = sum(p.float().sum() * 1e-3 for p in model.parameters())
    engine.backward(loss)
    engine.step()
    save_checkpoint(engine, path)
    dist.destroy_process_group()


def measure(checkpoint: str, out: str, dtype: str, shard_mb: int) -> dict:
    """Run in a fresh process: consolidate while sampling RssAnon every millisecond."""
    from zero_core.checkpoint import consolidate

    baseline = rss_anon()
    peak, done = [baseline], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    consolidate(checkpoint, out, dtype=dtype, max_shard_size=f"{shard_mb}MiB", progress=False)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return {"baseline": baseline, "peak": peak[0], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=1200)
    parser.add_argument("--largest-mb", type=int, default=32)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--measure", nargs=4, metavar=("CKPT", "OUT", "DTYPE", "SHARD_MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        ckpt, out, dtype, shard_mb = args.measure
        print(json.dumps(measure(ckpt, out, dtype, int(shard_mb))))
        return
    run(args)


def run(args) -> None:
    import socket

    import torch.multiprocessing as mp

    from zero_core.checkpoint import read_manifest

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        ckpt = str(Path(scratch, "ckpt"))
        mp.spawn(save_worker, args=(2, port, ckpt, args.tensors, args.largest_mb), nprocs=2)
        manifest = read_manifest(ckpt)
        count = len(manifest["parameters"])
        model_fp32 = sum(4 * _numel(p["shape"]) for p in manifest["parameters"])
        largest = max(4 * _numel(p["shape"]) for p in manifest["parameters"])
        on_disk = sum(f["bytes"] for f in manifest["files"].values())
        print(f"model: {count} tensors, {model_fp32 / MB:.1f} MiB in fp32 (largest {largest / MB:.1f} MiB); "
              f"checkpoint {on_disk / MB:.1f} MiB on disk; output shards of at most {args.shard_mb} MiB")
        print("| dtype | model in dtype (MiB) | peak above baseline (MiB) | bound: 2x largest + shard (MiB) | s |")
        print("| --- | --- | --- | --- | --- |")
        for dtype, size in (("bf16", 2), ("fp32", 4)):
            command = [sys.executable, __file__, "--measure", ckpt, str(Path(scratch, dtype)), dtype,
                       str(args.shard_mb)]
            result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            bound = largest * 2 + args.shard_mb * MB
            print(f"| {dtype} | {model_fp32 * size / 4 / MB:.1f} | {(result['peak'] - result['baseline']) / MB:.1f} "
                  f"| {bound / MB:.1f} | {result['seconds']:.1f} |")


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


if __name__ == "__main__":
    main()
