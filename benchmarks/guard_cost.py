"""The collective guard's cost on a stage-3 step (CPU proxy): ``python -m benchmarks.guard_cost``.

    python -m benchmarks.guard_cost --world-size 1 2 --blocks 48 --width 64 --steps 40

Each rank builds two identical models of many small blocks under stage 3 with every parameter partitioned
(``param_persistence_threshold: 0``: the most collectives per step, so the guard's per-call bookkeeping weighs
the most), one with the guard on (the default) and one with it off, and trains them in alternation, one step
each, so the machine's noise falls on both alike. Reported per world size: the median step time of each, their
ratio (whole steps; at N=1, or with --control, the guard is off in both: that ratio is the noise), and the guard's own parts
measured apart from the noise of the collectives: its bookkeeping per collective (record() and a wait on a
completed handle) and the step barrier alone; their sum per step as a share of the step without the guard.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class ManyBlocks(nn.Module):
    def __init__(self, blocks: int, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.mse_loss(x, torch.zeros_like(x))


def _rank(rank: int, world_size: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    import zero_core

    config = {"stage": 3, "param_persistence_threshold": 0}
    engines = {}
    for guarded in (True, False):
        model = ManyBlocks(args.blocks, args.width)
        engines[guarded] = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
        engines[guarded].comm.guard.enabled = guarded and world_size > 1 and not args.control
    times = {True: [], False: []}
    cpu = {True: [], False: []}
    barrier = []
    collectives = 0
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(step * 10 + rank))
        for guarded in ((True, False) if step % 2 else (False, True)):
            engine = engines[guarded]
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.backward(engine.module(x))
            engine.step()
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if step >= args.warmup:
                times[guarded].append(elapsed)
                cpu[guarded].append(cpu_elapsed)
                if guarded:
                    collectives = sum(entry["calls"] for entry in engine.comm_stats().values())
    guard = engines[True].comm.guard
    per_call = _bookkeeping_seconds(guard) if guard.enabled else 0.0
    if guard.enabled:  # the barrier on its own, the ranks lined up first as they are at a real step
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            guard.step_barrier()
            barrier.append(time.perf_counter() - start)
    if rank == 0:
        results.put({"world_size": world_size, "on": statistics.median(times[True]),
                     "off": statistics.median(times[False]),
                     "paired": statistics.median(a / b for a, b in zip(times[True], times[False])),
                     "cpu_paired": statistics.median(a / b for a, b in zip(cpu[True], cpu[False])),
                     "barrier": statistics.median(barrier) if barrier else 0.0, "per_call": per_call,
                     "collectives_per_step": collectives / (args.warmup + args.steps)})
    dist.destroy_process_group()


def _bookkeeping_seconds(guard, calls: int = 20000) -> float:
    """What the guard adds to one collective on this rank (CPU seconds): record() plus a wait on a completed
    handle, which is how a guarded wait differs from a plain one when nothing stalls."""
    work = dist.all_reduce(torch.zeros(1), async_op=True)
    work.wait()
    seq, fingerprint, history = guard.seq, guard.fingerprint, list(guard.history)
    start = time.process_time()  # CPU time: other jobs on the machine do not inflate it
    for _ in range(calls):
        guard.wait(work, guard.record("all_gather", 4096, torch.float32, "blocks.7"))
    elapsed = (time.process_time() - start) / calls
    guard.seq, guard.fingerprint = seq, fingerprint  # leave the guard as every other rank has it
    guard.history.clear()
    guard.history.extend(history)
    return elapsed


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.guard_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each engine")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--control", action="store_true",
                        help="A/A run: the guard off in both engines, to see the noise of the comparison")
    args = parser.parse_args(argv)
    context = mp.get_context("spawn")
    print("| N | blocks | collectives/step | step, guard on (ms) | step, guard off (ms) | on/off (medians) | "
          "on/off (median of paired steps) | CPU time on/off (paired) | bookkeeping per collective (µs) | "
          "step barrier (ms) | guard per step, % of step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for world_size in args.world_size:
        results = context.Queue()
        mp.start_processes(_rank, args=(world_size, _free_port(), args, results), nprocs=world_size,
                           start_method="spawn")
        r = results.get()
        print(f"| {world_size} | {args.blocks} | {r['collectives_per_step']:.0f} | {1e3 * r['on']:.2f} | "
              f"{1e3 * r['off']:.2f} | {r['on'] / r['off']:.3f} | {r['paired']:.3f} | {r['cpu_paired']:.3f} | "
              f"{1e6 * r['per_call']:.2f} | {1e3 * r['barrier']:.3f} | "
              f"{100 * (r['per_call'] * r['collectives_per_step'] + r['barrier']) / r['off']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
