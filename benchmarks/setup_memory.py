"""Setup's peak memory: the benchmark GPT built in fp32 (on the GPU where there is one, as benchmarks.gpu_offload
builds it), then ``zero_core.setup`` at stage 3 in bf16 with each offload config, each in its own process.
Reports, per config and in GiB: the fp32 model's bytes, the peak of the process's resident memory (host) and on
CUDA of allocated GPU memory, from the build through setup, and what is held after it.

    python -m benchmarks.setup_memory --layers 4 --width 1024      # about 60M parameters, a few seconds each

On a CPU-only machine the model and the masters share the host, so the host peak shows what setup copies: with
``offload_optimizer`` the masters are made in fp32 host memory straight from the bf16 shards (no fp32 copy first).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from .gpt import GPTConfig, build_gpt

CONFIGS = {
    "no offload": {},
    "offload_optimizer cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "offload_optimizer and offload_param cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                                                "offload_param": {"device": "cpu", "pin_memory": True}},
}
GIB = 2**30


def _rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / GIB


def worker(name: str, config: GPTConfig) -> dict:
    import os

    import torch.distributed as dist

    import zero_core

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    before = _rss_gib()
    with device:
        model = build_gpt(config)
    fp32 = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    optimizer = torch.optim.AdamW(model.parameters())
    engine = zero_core.setup(model, optimizer, {"bf16": {"enabled": True},
                                                "zero_optimization": {"stage": 3, **CONFIGS[name]}})
    result = {"config": name, "fp32_model_gib": fp32,
              "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - before,
              "host_after_gib": _rss_gib() - before,
              "gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
              "gpu_after_gib": torch.cuda.memory_allocated() / GIB if cuda else None}
    engine.close()
    dist.destroy_process_group()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.setup_memory", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    config = GPTConfig(vocab=32000, d_model=args.width, n_layer=args.layers, n_head=max(args.width // 128, 1))
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, config)), flush=True)
        return
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    print(f"{where}; d {args.width}, {args.layers} layers, stage 3, bf16; GiB, from the fp32 model's build on")
    print("| config | fp32 model | host peak | host after | GPU peak | GPU after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.configs:
        done = subprocess.run([sys.executable, "-m", "benchmarks.setup_memory", "--worker", name, "--layers",
                               str(args.layers), "--width", str(args.width)], capture_output=True, text=True,
                              timeout=600)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{name}: exited {done.returncode}\n{(done.stdout + done.stderr)[-2000:]}")
            continue
        r = json.loads(lines[-1][7:])

        def gib(value) -> str:
            return "-" if value is None else f"{value:.2f}"
        print(f"| {name} | {gib(r['fp32_model_gib'])} | {gib(r['host_peak_gib'])} | {gib(r['host_after_gib'])} | "
              f"{gib(r['gpu_peak_gib'])} | {gib(r['gpu_after_gib'])} |", flush=True)


if __name__ == "__main__":
    main()
