"""Where the GPU memory goes: each implementation's peak per phase (forward, backward, step) and the live CUDA
allocations at its traced peak, grouped by the Python frames that allocated them
(``torch.cuda.memory._record_memory_history``).

    python -m benchmarks.gpu_memory memory_at_peak.txt                    # the GPU tier's runs (tests/gpu)
    python -m benchmarks.gpu_memory out.txt --preset 873M --impls plain zero3   # benchmarks.gpu's models

Every run starts after ``gc.collect()`` and ``torch.cuda.empty_cache()``: a model and its engine refer to each
other, so a dropped pair is freed by the cycle collector, not at once, and without it a run's peak counts the
previous run's state. The recording starts before the model is built, so the traced peak is the whole peak above
what was allocated before the run (reported as "before": the cuBLAS workspaces of earlier runs).
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
import gpu_workers  # noqa: E402  (the GPU tier's own runs, so the figures are the tier's)

FRAMES_OF_INTEREST = ("zero_core", "gpu_workers", "benchmarks", "torch/optim", "autograd", "torch/distributed/fsdp")


def live_at_peak(snapshot: dict) -> tuple[int, dict]:
    """The highest sum of live allocations in the recorded history, and the allocations live at that moment."""
    live, current, peak, at_peak = {}, 0, 0, {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    return peak, at_peak


def report(label: str, snapshot: dict) -> str:
    peak, at_peak = live_at_peak(snapshot)
    groups: collections.Counter = collections.Counter()
    for event in at_peak.values():
        frames = [f for f in event.get("frames", []) if any(k in f["filename"] for k in FRAMES_OF_INTEREST)]
        where = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:4])
        groups[where or "(no python frame)"] += event["size"]
    lines = [f"\n## {label}: traced peak {peak / 2**20:.1f} MiB, {len(at_peak)} live blocks"]
    lines += [f"{size / 2**20:9.2f} MiB  {where}" for where, size in groups.most_common(25)]
    return "\n".join(lines) + "\n"


class PhasePeaks:
    """The highest ``max_memory_allocated`` seen in each phase of a step, over all steps (MiB above ``base``)."""

    def __init__(self, base: int) -> None:
        self.base, self.peaks = base, collections.defaultdict(int)

    def phase(self, name: str, fn, *args):
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args)
        torch.cuda.synchronize()
        self.peaks[name] = max(self.peaks[name], torch.cuda.max_memory_allocated() - self.base)
        return out

    def line(self) -> str:
        return ", ".join(f"{name} {value / 2**20:.0f} MiB" for name, value in self.peaks.items())


def preset_run(impl: str, preset: str, steps: int) -> tuple[str, PhasePeaks]:
    """One implementation of benchmarks.gpu on one of its models, step by step, phase by phase."""
    from . import gpu

    config = gpu.PRESETS[preset]
    phases = PhasePeaks(torch.cuda.memory_allocated())
    forward_backward, step, keep = phases.phase("build", gpu.build, impl, config, False)
    for index in range(steps):
        tokens, targets = (t.cuda() for t in gpu.batch(config, 0, index))
        phases.phase("forward+backward", forward_backward, tokens, targets)
        phases.phase("step", step)
    stats = keep[0].memory_stats() if hasattr(keep[0], "memory_stats") else None
    del keep, forward_backward, step
    return f"memory_stats {stats}", phases


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_memory", description=__doc__.splitlines()[0])
    p.add_argument("out", help="the report (also printed)")
    p.add_argument("--preset", default=None, help="a model of benchmarks.gpu (default: the GPU tier's runs)")
    p.add_argument("--impls", nargs="+", default=["plain", "zero1", "zero2", "zero3"])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    text = f"# {torch.cuda.get_device_name(0)}; preset {args.preset or 'the GPU tier (tests/gpu/gpu_workers.py)'}\n"
    for impl in args.impls:
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
        if args.preset is None:
            result = gpu_workers.plain(device) if impl == "plain" else gpu_workers.engine_run(device, int(impl[-1]))
            detail = f"peak {result['peak'] / 2**20:.1f} MiB (max_memory_allocated), memory_stats {result.get('memory')}"
        else:
            detail, phases = preset_run(impl, args.preset, args.steps)
            detail += f"\nphase peaks above before: {phases.line()}"
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        text += f"\n# {impl}: before {before / 2**20:.1f} MiB; {detail}\n" + report(impl, snapshot)
        del snapshot
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
