"""A master piece bigger than the NVMe tile steps slice by slice through the swap file (nvme_slices.py): the step
holds a few slices of it, not the whole piece and its Adam moments (a first step included).

Two ranks, the tile made 1000 elements so that each Linear weight's piece (2048 elements a rank at stage 3, more at
stage 2) is several slices of 960. Each run trains against the same run with pieces stepped whole (as before
slicing: ``optimizer.step()`` on the swapped-in piece, torch's fused kernel): weights bit for bit, for AdamW and
Adam with amsgrad, bf16, fp16 with a loss scale and clipping, and fp32, at stages 2 and 3 (also with
``offload_param: nvme``, and with ``aio.overlap_events: false``: every transfer waited at once); the fp32 run also
bit for bit the run without offload (tested against DDP elsewhere). Between steps the swap holds nothing; during
the step at most three slices' buffers were read in, while the whole-piece run read a whole piece and its moments.
The moments the slices wrote are what a checkpoint reads back: Adam's state after training is the whole-piece
run's."""

from __future__ import annotations

import tempfile

import pytest
import torch

import zero_core
from distributed import run_distributed

WIDTH = 64
TILE = 1000
SLICE = TILE // 64 * 64
RUNS = {
    "stage 3, bf16, AdamW": ({"stage": 3, "bf16": {"enabled": True}}, "adamw"),
    "stage 3, fp32, Adam amsgrad, offload_param nvme": ({"stage": 3, "offload_param": "nvme"}, "amsgrad"),
    "stage 2, bf16, AdamW": ({"stage": 2, "bf16": {"enabled": True}}, "adamw"),
    "stage 2, fp32, AdamW": ({"stage": 2}, "adamw"),
    "stage 2, fp16, loss scale, clipping, AdamW": ({"stage": 2, "fp16": {"enabled": True, "initial_scale_power": 8},
                                                    "gradient_clipping": 0.05}, "adamw"),
    "stage 3, bf16, AdamW, aio waited at once": ({"stage": 3, "bf16": {"enabled": True},
                                                  "aio": {"overlap_events": False}}, "adamw"),
}


def _optimizer(kind: str, params):
    if kind == "amsgrad":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2)


def _train(rank: int, config: dict, kind: str, nvme_path, whole: bool = False) -> dict:
    from zero_core.offload import nvme_slices

    sliced = nvme_slices.sliced
    if whole:
        nvme_slices.sliced = lambda *args: False
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        config = dict(config, param_persistence_threshold=0)
        if nvme_path is not None:
            config["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
            if config.pop("offload_param", None):
                config["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
        else:
            config.pop("offload_param", None)
        engine = zero_core.setup(model, _optimizer(kind, model.parameters()), config)
        dtype = torch.bfloat16 if "bf16" in config else torch.float16 if "fp16" in config else torch.float32
        held, peaks = [], []
        swapper = engine._offload.swapper if nvme_path is not None else None
        for step in range(3):
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank), dtype=dtype)
            engine.backward(engine.module(x).float().square().mean())
            engine.step()
            if swapper is not None:
                held.append(swapper.read_in_bytes + swapper._free_bytes)
                peaks.append(swapper.peak_read_in_bytes)
                swapper.peak_read_in_bytes = 0
        with zero_core.GatheredParameters(list(engine.module.parameters())):
            weights = [p.detach().float().clone() for p in engine.module.parameters()]
        params = list(engine.module.parameters())
        state = [zero_core.safe_get_full_optimizer_state(p, key).clone() for p in params
                 for key in ("exp_avg", "exp_avg_sq")]  # swapped in whole, as a checkpoint reads them
        slices = engine._offload.slices_stepped if nvme_path is not None else 0
        if nvme_path is not None:
            engine.remove_offload_files()
        engine.close()
        return {"weights": weights, "held": held, "peaks": peaks, "slices": slices, "state": state}
    finally:
        nvme_slices.sliced = sliced


def _worker(rank: int, world_size: int) -> dict:
    from zero_core.offload import cpu_optimizer

    cpu_optimizer.NVME_TILE_NUMEL = TILE
    results = {}
    with tempfile.TemporaryDirectory() as nvme_path:
        for label, (config, kind) in RUNS.items():
            results[label] = {"sliced": _train(rank, config, kind, nvme_path),
                              "whole": _train(rank, config, kind, nvme_path, whole=True)}
            if "fp32" in label:
                results[label]["plain"] = _train(rank, config, kind, None)
    return results


@pytest.mark.timeout(300)
def test_a_piece_bigger_than_the_tile_steps_in_slices_bit_for_bit():
    for rank, results in enumerate(run_distributed(_worker, 2, timeout=260)):
        for label, runs in results.items():
            where = f"rank {rank}, {label}"
            sliced, whole = runs["sliced"], runs["whole"]
            assert sliced["slices"] > 0 and whole["slices"] == 0, (where, sliced["slices"], whole["slices"])
            for a, b in zip(sliced["weights"], whole["weights"]):
                assert torch.equal(a, b), where
            if "plain" in runs:
                for a, b in zip(sliced["weights"], runs["plain"]["weights"]):
                    assert torch.equal(a, b), f"{where}: against the run without offload"
            for a, b in zip(sliced["state"], whole["state"]):
                assert torch.equal(a, b), f"{where}: Adam's moments read back from the file"
            if "plain" in runs:
                for a, b in zip(sliced["state"], runs["plain"]["state"]):
                    assert torch.equal(a, b), f"{where}: Adam's moments against the run without offload"
            assert all(held == 0 for held in sliced["held"]), (where, sliced["held"])  # nothing between steps
            per_element = 4 * (4 if "amsgrad" in label else 3)  # fp32 master and Adam's moments
            piece = WIDTH * WIDTH // (2 if "stage 3" in label else 1)  # the largest piece on this rank, at most
            for peak in sliced["peaks"]:  # the first step too: its moments are made a slice at a time
                assert peak <= 3 * SLICE * per_element, (where, sliced["peaks"])
            assert max(whole["peaks"][1:]) >= piece // 2 * per_element, (where, whole["peaks"])
