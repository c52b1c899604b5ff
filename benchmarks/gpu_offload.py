"""Issue 19 on one GPU: a GPT of Llama-7B width (d 4096, 32 heads) trained in bf16 with the optimizer on the CPU,
our stage 3 with ``offload_optimizer: {device: cpu, pin_memory: true}`` (``zero3``), with ``offload_param`` as
well (``zero3_param``, what FSDP2's policy offloads), against FSDP2 with ``CPUOffloadPolicy``
(bf16 ``MixedPrecisionPolicy``, torch's fused CPU AdamW), each in its own process, one after the other.

    python -m benchmarks.gpu_offload --layers 32                 # about 6.6B parameters
    python -m benchmarks.gpu_offload --layers 8 --impls zero3    # a quick look
    python -m benchmarks.gpu_offload --impls zero3 zero3_delayed --steps 3 --warmup 3   # the delayed update

``zero3`` overlaps the host step with the next forward (``overlap_step``, on by default: its forward+backward
column then includes waits for the step); ``zero3_inline`` runs it inline (``overlap_step: false``), so its
forward+backward is the GPU's alone and its step minus that is the host step: issue 38's exact-overlap target is
``zero3``'s step <= 1.10x the larger of the two.

``zero3_delayed`` is ``zero3`` with ``delayed_update_after: 1`` (docs/offload.md, "Delayed parameter update"): its
step time against ``zero3``'s forward+backward is issue 38's target for the delayed update (use ``--warmup`` 3 or
more, so that every timed step has an update in flight).

Reports per implementation: parameters, median step (s), tokens/s, peak GPU memory and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from .gpt import GPTConfig, batch, build_gpt, num_params


def worker(impl: str, config: GPTConfig, steps: int, warmup: int, profile_step: bool = False) -> dict:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29557")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = build_gpt(config)
    psi = num_params(model)
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if impl == "zero3_param":  # parameters too, as FSDP2's CPUOffloadPolicy does
        offload["offload_param"] = {"device": "cpu", "pin_memory": True}
    if impl == "zero3_inline":  # the step inline, as before issue 38's overlap (the host step alone: step - f+b)
        offload["offload_optimizer"]["overlap_step"] = False
    if impl == "zero3_delayed":  # issue 38: the host step of step t during step t+1's forward and backward
        offload["offload_optimizer"]["delayed_update_after"] = 1
    if impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                      offload_policy=CPUOffloadPolicy(pin_memory=True))
        for block in model.blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def forward_backward(tokens, targets):
            model(tokens, targets).backward()

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        import zero_core

        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, **offload}})
        del model

        def forward_backward(tokens, targets):
            engine.backward(engine.module(tokens, targets))

        step = engine.step
    setup_s = time.perf_counter() - t0
    times, phases = [], []
    for s in range(warmup + steps):
        tokens, targets = (t.cuda() for t in batch(config, 0, s))
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward(tokens, targets)
        torch.cuda.synchronize()
        middle = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - start)
            phases.append(middle - start)
    profile = None
    if profile_step:  # one more step under the profiler: where the host's step time goes
        from torch.profiler import ProfilerActivity, profile as profiler

        tokens, targets = (t.cuda() for t in batch(config, 0, warmup + steps))
        forward_backward(tokens, targets)
        torch.cuda.synchronize()
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        profile = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60)
    dist.destroy_process_group()
    return {"profile": profile, "impl": impl, "params": psi, "setup_s": setup_s, "step_s": statistics.median(times),
            "forward_backward_s": statistics.median(phases), "threads": torch.get_num_threads(),
            "tokens_per_s": config.batch_size * config.seq_len / statistics.median(times),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_offload", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--impls", nargs="+", default=["zero3", "zero3_param", "fsdp2"], choices=("zero3", "zero3_inline", "zero3_param", "zero3_delayed", "fsdp2"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600, help="seconds per implementation's process")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per implementation")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = GPTConfig(vocab=32000, d_model=args.width, n_layer=args.layers, n_head=args.width // 128,
                       seq_len=args.seq_len, batch_size=args.batch_size)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, config, args.steps, args.warmup, args.profile)), flush=True)
        return
    rows = []
    for impl in args.impls:
        cmd = [sys.executable, "-m", "benchmarks.gpu_offload", "--worker", impl, "--layers", str(args.layers),
               "--width", str(args.width), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--profile"] if args.profile else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{impl}: timed out after {args.timeout} s")
            continue
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{impl}: exited {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
            continue
        rows.append(json.loads(lines[-1][7:]))
    print(f"{torch.cuda.get_device_name(0)}; d {args.width}, {args.layers} layers, batch {args.batch_size}x{args.seq_len}, "
          f"bf16, AdamW, optimizer on the CPU; median of {args.steps} steps after {args.warmup}")
    print("| implementation | params | step s | of which forward+backward | tokens/s | peak GPU GiB | peak RSS GiB | "
          "setup s | torch threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['impl']} | {r['params'] / 1e9:.2f}B | {r['step_s']:.2f} | {r['forward_backward_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {r['peak_gpu_gib']:.1f} | {r['peak_rss_gib']:.1f} | {r['setup_s']:.0f} | "
              f"{r['threads']} |")
    for r in rows:
        if r.get("profile"):
            print(f"\n{r['impl']}: one step under torch.profiler\n{r['profile']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
