"""The cost of "no gradient, no step": the step's one flag all-reduce (engine._agree_on_step), timed alone.

    python -m benchmarks.flag_cost      (2 gloo ranks on this machine, the benchmark GPT, stages 1-3)

Every trainable tensor is marked as having a gradient, as in a step where all were used; collective checks are
off, as in steady state. Prints the median over 300 calls on rank 0.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .gpt import GPT, GPTConfig
from .run import _free_port as free_port


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    import zero_core

    for stage in (1, 2, 3):
        model = GPT(GPTConfig())
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"stage": stage})
        engine._pending[0].used.update(engine.trainable_params())
        engine.comm.check = False  # stage 3 verifies collectives only while it records its first trace
        times = []
        for _ in range(300):
            dist.barrier()
            start = time.perf_counter()
            engine._agree_on_step(0)
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"stage {stage}: one uint8 all-reduce of {len(engine.trainable_params()) + 1} flags: "
                  f"median {statistics.median(times) * 1e6:.0f} us per optimizer step")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(free_port(),), nprocs=2)
