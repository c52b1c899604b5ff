"""Issue 18's table on one GPU: plain bf16 autocast, FSDP2 and our stages on the same GPT, in one process.

    python -m benchmarks.gpu                      # the 873M and 110M models of the issue
    python -m benchmarks.gpu --preset tiny        # seconds; what tests/gpu runs
    python -m benchmarks.gpu --compile            # every implementation under torch.compile

World size 1 (NCCL), AdamW, a GPT with a tied head. Plain and FSDP2 keep fp32 weights under bf16 autocast
(FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16)``); the engine trains bf16 weights with fp32 masters. Each
implementation is built fresh on the same weights, warmed up, then timed with CUDA events; implementations
are interleaved over repeats. Reports the median step, × plain, peak ``torch.cuda.max_memory_allocated`` (above what was
allocated before the implementation was built) and tokens/s, as a Markdown table. Every implementation runs
AdamW(fused=True).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch
import torch.distributed as dist

from .gpt import GPTConfig, batch, build_gpt

PRESETS = {
    "873M": GPTConfig(vocab=50304, d_model=2048, n_layer=16, n_head=16, seq_len=1024, batch_size=4),
    "110M": GPTConfig(vocab=50304, d_model=768, n_layer=12, n_head=12, seq_len=1024, batch_size=8),
    "tiny": GPTConfig(vocab=1024, d_model=128, n_layer=2, n_head=4, seq_len=64, batch_size=4),
}
IMPLS = ("plain", "fsdp2", "zero1", "zero2", "zero3")


def build(impl: str, config: GPTConfig, compile_model: bool):
    """(forward_backward(tokens, targets), step(), cleanup objects) for one implementation on the GPU."""
    with torch.device("cuda"):  # initialised on the GPU: seconds, not a minute of CPU normal_ per build
        model = build_gpt(config)
    if impl in ("plain", "fsdp2"):
        if impl == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        forward = torch.compile(model) if compile_model else model

        def forward_backward(tokens, targets):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=impl == "plain"):
                loss = forward(tokens, targets)
            loss.backward()
            return loss

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return forward_backward, step, (model, optimizer)
    import zero_core

    # fused=True as for plain and FSDP2 above: the same optimizer kernel for everyone (torch's default on CUDA is
    # foreach, several passes over memory per step).
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                             {"stage": int(impl[-1]), "bf16": {"enabled": True}})
    forward = torch.compile(engine.module) if compile_model else engine.module

    def forward_backward(tokens, targets):
        loss = forward(tokens, targets)
        engine.backward(loss)
        return loss

    return forward_backward, engine.step, (engine, model)


def measure(impl: str, config: GPTConfig, steps: int, warmup: int, compile_model: bool) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()  # what the implementations before this one left (none, unless leaked)
    forward_backward, step, keep = build(impl, config, compile_model)
    data = [tuple(t.cuda() for t in batch(config, 0, s)) for s in range(warmup + steps)]
    times = []
    for index, (tokens, targets) in enumerate(data):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward(tokens, targets)
        step()
        end.record()
        if index >= warmup:
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    result = {"step_s": statistics.median(times), "peak_gib": (torch.cuda.max_memory_allocated() - baseline) / 2**30,
              "left_before_gib": baseline / 2**30}
    del keep, forward_backward, step
    gc.collect()
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--preset", nargs="+", default=["873M", "110M"], choices=sorted(PRESETS))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA GPU (the CPU benchmarks are benchmarks.run and benchmarks.proxy)")
    if "plain" not in args.impls:
        raise SystemExit("plain must be among --impls: the ratios are against it")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    results = {}
    for preset in args.preset:
        config = PRESETS[preset]
        for repeat in range(args.repeats):
            for impl in args.impls[repeat % len(args.impls):] + args.impls[: repeat % len(args.impls)]:
                run = measure(impl, config, args.steps, args.warmup, args.compile)
                best = results.setdefault(preset, {}).get(impl)
                if best is None or run["step_s"] < best["step_s"]:
                    results[preset][impl] = run
    dist.destroy_process_group()
    print(f"{torch.cuda.get_device_name(0)}, world size 1, bf16, AdamW{', torch.compile' if args.compile else ''}; "
          f"median step over {args.steps}, best of {args.repeats} interleaved repeats")
    print("| model | implementation | step s | × plain | peak GiB | tokens/s | GiB left allocated before |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for preset, rows in results.items():
        config, plain = PRESETS[preset], rows["plain"]["step_s"]
        for impl, row in rows.items():
            tokens = config.batch_size * config.seq_len / row["step_s"]
            print(f"| {preset} | {impl} | {row['step_s']:.4f} | {row['step_s'] / plain:.2f} | {row['peak_gib']:.1f} | "
                  f"{tokens:,.0f} | {row['left_before_gib']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
