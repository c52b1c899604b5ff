"""Live CUDA allocations at the traced peak of the GPU tier's runs (tests/gpu/gpu_workers.py: plain, stages 1-3),
grouped by the Python frames that allocated them (``torch.cuda.memory._record_memory_history``).

    python -m benchmarks.gpu_memory memory_at_peak.txt

Caveat, seen on an H200: for the engine's runs the traced peak (the recorded allocations replayed) came out
below ``max_memory_allocated`` by more than the cuBLAS workspaces allocated before recording began (about 64 MiB,
one per autograd thread), so something the history does not show is still missing. Read the groups as what is
live at that moment, not as the whole peak.
"""

from __future__ import annotations

import collections
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
import gpu_workers  # noqa: E402  (the GPU tier's own runs, so the figures are the tier's)

FRAMES_OF_INTEREST = ("zero_core", "gpu_workers", "torch/optim", "autograd")


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
    lines += [f"{size / 2**20:8.2f} MiB  {where}" for where, size in groups.most_common(25)]
    return "\n".join(lines) + "\n"


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    runs = {"plain": lambda: gpu_workers.plain(device)}
    runs.update({f"zero{stage}": (lambda stage=stage: gpu_workers.engine_run(device, stage)) for stage in (1, 2, 3)})
    text = ""
    for label, run in runs.items():
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        result = run()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        text += f"\n# {label}: peak {result['peak'] / 2**20:.1f} MiB, memory_stats {result.get('memory')}\n"
        text += report(label, snapshot)
    with open(sys.argv[1], "w") as f:
        f.write(text)
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
