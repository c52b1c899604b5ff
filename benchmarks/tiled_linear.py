"""Stage 3's gathered-element peak over one large linear layer's forward and backward, tiled and untiled (CPU).

A 4096x4096 layer (with bias) split 4x4 by ``zero_core.TiledLinear`` against the same ``nn.Linear``, stage 3 with
``stage3_param_persistence_threshold=0`` on 2 gloo ranks. The engine counts gathered elements
(``engine.runtime.peak_live_elements``, prefetch included); the peak is read over the second step's forward and
backward, once prefetch follows the recorded trace. Target (issue 37): the tiled peak is at most 1/16 of the layer
plus the next tile's prefetch. ``zero-estimate`` reads the same unit plan: its live-parameter term for the tiled
model is printed next to the untiled one.

    python benchmarks/tiled_linear.py [--size 4096] [--splits 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time


def _worker(rank: int, world_size: int, port: int, size: int, splits: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import zero_core

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    results = {}
    for tiled in (True, False):
        torch.manual_seed(0)
        layer = zero_core.TiledLinear(size, size, in_splits=splits, out_splits=splits) if tiled else nn.Linear(size, size)
        model = nn.Sequential(layer)
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                 {"stage": 3, "stage3_param_persistence_threshold": 0})
        seconds = 0.0
        for step in range(2):
            x = torch.randn(4, size, requires_grad=True)  # as inside a network: the input needs a gradient
            if step == 1:
                engine.runtime.peak_live_elements = engine.runtime.live_elements
            start = time.perf_counter()
            engine.backward(model(x).square().mean())
            seconds = time.perf_counter() - start
            engine.step()
        results["tiled" if tiled else "untiled"] = {
            "peak_gathered_elements": engine.runtime.peak_live_elements,
            "units": len(engine.runtime.units),
            "largest_unit": max(u.numel for u in engine.runtime.units),
            "forward_backward_s": round(seconds, 3),
        }
        engine.close()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _estimate(size: int, splits: int) -> dict:
    """The estimator's live-parameter bytes at stage 3 (default budgets), per rank at world size 2, on the meta
    device."""
    import torch
    from torch import nn

    import zero_core
    from zero_core.tools.estimator import estimate_stage

    out = {}
    with torch.device("meta"):
        models = {"tiled": zero_core.TiledLinear(size, size, in_splits=splits, out_splits=splits),
                  "untiled": nn.Linear(size, size)}
    config = {"stage": 3, "stage3_param_persistence_threshold": 0}
    for name, model in models.items():
        out[name] = estimate_stage(model, config, world_size=2, precision="fp32").live_params
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--splits", type=int, default=4)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, args.size, args.splits, queue), nprocs=2, start_method="spawn")
    results = queue.get()
    layer = args.size * args.size + args.size
    tile = layer // (args.splits * args.splits)
    results["layer_elements"] = layer
    results["target_elements"] = tile + results["tiled"]["largest_unit"]  # 1/16 of the layer + the next tile
    results["meets_target"] = results["tiled"]["peak_gathered_elements"] <= results["target_elements"]
    results["estimator_live_param_bytes"] = _estimate(args.size, args.splits)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
