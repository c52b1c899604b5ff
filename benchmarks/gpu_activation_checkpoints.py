"""Peak GPU memory and step time of a 24-layer model's activation checkpoints at stage 3, with and without
``cpu_checkpointing`` (CUDA only).

Each of ``--layers`` residual MLP blocks runs under ``zero_core.checkpointing.checkpoint``; stage 3 on one GPU
(world size 1, bf16, ``stage3_param_persistence_threshold=0``). Modes: ``checkpoint`` (the block's defaults:
torch.utils.checkpoint keeps each block's input on the GPU), ``cpu`` (``cpu_checkpointing``: the inputs wait in
pinned host memory and come back on a side stream ahead of their recomputation), and ``none`` (no checkpointing,
for scale). Per mode: the peak of ``max_memory_allocated`` over forward and backward above what was allocated
before them (the optimizer step's own transients, an fp32 copy of the gradients, are left out: they are the same
in every mode and larger than these activations), and the median step time (forward, backward and step).
Target (issue 37): the ``cpu`` peak is lower by the checkpointed inputs' bytes (``layers x tokens x hidden x 2``,
printed; less three layers' worth: the first block's input is the caller's tensor, and
at the start of backward one input is back for its recomputation and the next one on its way), at a step time
within 1.10x of ``checkpoint``'s. Each mode also prints (stderr) and records its peak by phase, from one more
step synchronized between phases: ``forward``, ``backward`` (autograd's pass: recomputations, each checkpoint's
backward) and ``gradient flush`` (the engine's end-of-backward reduction into the gradient shards), and which
phase holds the peak; ``reserved_MiB`` is what the caching allocator holds for the mode (blocks a side-stream
copy still reads are held there, not counted as allocated). About 20 s on an H100 (one extra step per mode).

    python -m benchmarks.gpu_activation_checkpoints [--layers 24] [--hidden 1024] [--tokens 8192] [--steps 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_activation_checkpoints",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8192, help="batch x sequence, the rows of each activation")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["checkpoint", "cpu", "none"],
                   choices=["checkpoint", "cpu", "none"])
    p.add_argument("--out", default=None, help="also write the JSON result here")
    return p.parse_args(argv)


def build(layers: int, hidden: int):
    import torch
    from torch import nn

    from zero_core.checkpointing import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Model(nn.Module):
        def __init__(self, checkpointed: bool):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.checkpointed = checkpointed

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x) if self.checkpointed else block(x)
            return x.float().square().mean()

    return Model


def run_mode(mode: str, args, device) -> dict:
    import torch

    import zero_core
    from zero_core import checkpointing

    gc.collect()
    torch.cuda.empty_cache()
    reserved_at_start = torch.cuda.memory_reserved()
    torch.manual_seed(0)
    model = build(args.layers, args.hidden)(checkpointed=mode != "none").to(device)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": True},
              "activation_checkpointing": {"cpu_checkpointing": mode == "cpu"}}
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    times, peaks = [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        engine.backward(model(x))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        engine.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            peaks.append(peak)
    phases = phase_peaks(engine, model, x)  # one more step, synchronized between its phases (untimed)
    where = max(phases, key=phases.get)
    print(f"{mode}: peak {max(peaks) / 2**20:.1f} MiB; by phase "
          + ", ".join(f"{name} {value / 2**20:.1f}" for name, value in phases.items())
          + f" MiB: the peak is in the {where}", file=sys.stderr)
    stats = vars(checkpointing.current().stats).copy()
    steps = args.warmup + args.steps + 1
    reserved = torch.cuda.memory_reserved() - reserved_at_start
    engine.close()
    del engine, model, x
    return {"peak_forward_backward_MiB": round(max(peaks) / 2**20, 1), "peak_phase": where,
            "phase_peaks_MiB": {name: round(value / 2**20, 1) for name, value in phases.items()},
            "reserved_MiB": round(reserved / 2**20, 1),
            "step_s": round(statistics.median(times), 4),
            "host_bytes_per_step": stats["host_bytes"] // steps,
            "prefetched": stats["prefetched"]}


def phase_peaks(engine, model, x) -> dict:
    """One step's peak allocated memory (above what was allocated before it) in each phase: ``forward``;
    ``backward``, autograd's pass (the recomputations, each checkpoint's backward, the gradients staged for
    reduction); ``gradient flush``, the engine's end-of-backward callback (the reduced gradients added into their
    shards). The split is a callback queued from a hook on the loss: autograd runs its callbacks in the order
    queued, and this one is queued before the engine's (the loss's gradient comes first)."""
    import torch
    from torch.autograd import Variable

    peaks: dict = {}
    base = [0]

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base[0]
        torch.cuda.reset_peak_memory_stats()

    torch.cuda.synchronize()
    base[0] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(x)
    mark("forward")
    loss.register_hook(lambda grad: Variable._execution_engine.queue_callback(lambda: mark("backward")))
    engine.backward(loss)
    mark("gradient flush")
    engine.step()
    torch.cuda.synchronize()
    return peaks


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.gpu_activation_checkpoints needs CUDA (a GPU): it measures GPU memory and step time; "
              "nothing was run", file=sys.stderr)
        return 2
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    result = {"device": torch.cuda.get_device_name(0), "layers": args.layers, "hidden": args.hidden,
              "tokens": args.tokens,
              "checkpointed_input_MiB": round(args.layers * args.tokens * args.hidden * 2 / 2**20, 1)}
    for mode in args.modes:
        result[mode] = run_mode(mode, args, device)
    if "checkpoint" in result and "cpu" in result:
        result["peak_saved_MiB"] = round(result["checkpoint"]["peak_forward_backward_MiB"]
                                         - result["cpu"]["peak_forward_backward_MiB"], 1)
        result["step_time_ratio"] = round(result["cpu"]["step_s"] / result["checkpoint"]["step_s"], 3)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
