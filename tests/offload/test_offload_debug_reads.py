"""With NVMe offload, ``full_state_dict`` and the ``safe_get_full_*`` functions read the swapped masters (and
optimizer state) of one parameter at a time, not all of it: the swapper's peak of bytes read in stays within the
largest parameter's share (a piece bigger than the tile read a slice at a time: within a tile's master and
moments), and the values are those of the same training without offload (2 ranks, stages 2 and 3).
``safe_set_full_fp32_param`` and ``GatheredParameters`` with a modifier write the parameter's master back to the
swap file, reading in only the masters they rewrite (at stage 3 those of the parameter's unit)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import EngineDriver, make_optimizer, train_loop

STEPS = 3
SMALL = {"reduce_bucket_size": 100, "allgather_bucket_size": 100, "sub_group_size": 120,
         "param_persistence_threshold": 0}


class _NoScheduler:
    def step(self) -> None:
        pass


def _trained(stage: int, nvme_dir) -> object:
    config = {"stage": stage, **SMALL}
    if nvme_dir is not None:
        config["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    model = build_model("transformer", seed=1)
    engine = zero_core.setup(model, make_optimizer(model), config)
    rank = dist.get_rank()
    train_loop(EngineDriver(engine), _NoScheduler(), lambda s, m: make_batch("transformer", rank, s, m), STEPS,
               accumulation=2, clip=0.5)
    return engine


def _reads(engine) -> dict:
    """What the reads give; with NVMe also the swapper's peak of bytes read in during them."""
    swapper = engine._offload.swapper if engine._offload is not None else None
    if swapper is not None:
        swapper.peak_read_in_bytes = swapper.read_in_bytes
    params = dict(engine.module.named_parameters())
    first = next(name for name, p in params.items() if p.requires_grad)
    out = {"full": engine.full_state_dict(rank0_only=False),
           "fp32": zero_core.safe_get_full_fp32_param(params[first]),
           "exp_avg_sq": zero_core.safe_get_full_optimizer_state(params[first], "exp_avg_sq"),
           "peak": swapper.peak_read_in_bytes if swapper is not None else None}
    if swapper is not None:
        swapper.peak_read_in_bytes = swapper.read_in_bytes
    zero_core.safe_set_full_fp32_param(params[first], out["fp32"] * 2)  # written back to the swap file
    out["set_peak"] = swapper.peak_read_in_bytes if swapper is not None else None
    out["doubled"] = zero_core.safe_get_full_fp32_param(params[first])
    if swapper is not None:
        swapper.peak_read_in_bytes = swapper.read_in_bytes
    with zero_core.GatheredParameters([params[first]], modifier_rank=0):  # halved again, on rank 0
        if dist.get_rank() == 0:
            params[first].data.mul_(0.5)
    out["gathered_peak"] = swapper.peak_read_in_bytes if swapper is not None else None
    out["halved"] = zero_core.safe_get_full_fp32_param(params[first])
    moment = torch.rand(params[first].shape, generator=torch.Generator().manual_seed(3))
    zero_core.safe_set_full_optimizer_state(params[first], moment, "exp_avg_sq")  # (NVMe: in slices, not read)
    out["moment_back"] = torch.equal(zero_core.safe_get_full_optimizer_state(params[first], "exp_avg_sq"), moment)
    # what those two read in: the masters they rewrite (stage 3: the parameter's whole unit), 4 bytes each
    out["rewritten"] = sum(swapper.shape_of(f.master, "__master__")[0].numel() * 4
                           for f in engine.rewritten_fragments([params[first]])) if swapper is not None else None
    return out


def _worker(rank: int, world_size: int) -> dict:
    results = {}
    for stage in (2, 3):
        plain = _reads(_trained(stage, None))
        with tempfile.TemporaryDirectory() as nvme_dir:
            engine = _trained(stage, nvme_dir)
            swapper = engine._offload.swapper
            swapped = _reads(engine)
            largest_master = max(shape.numel() * 4 for (_, key), (shape, _) in swapper._shapes.items()
                                 if key == "__master__")
            results[stage] = {
                "peak": swapped["peak"], "left": swapper.read_in_bytes, "bound": 3 * largest_master,
                "tile_bound": 12 * SMALL["sub_group_size"],  # a tile's master and moments
                "file": swapper.file_bytes(),
                "max_diff": max((swapped["full"][k].float() - v.float()).abs().max().item()
                                for k, v in plain["full"].items()),
                "fp32": torch.allclose(swapped["fp32"], plain["fp32"], rtol=0, atol=1e-6),
                "exp_avg_sq": torch.allclose(swapped["exp_avg_sq"], plain["exp_avg_sq"], rtol=1e-5, atol=0),
                "doubled": torch.equal(swapped["doubled"], swapped["fp32"] * 2),
                "halved": torch.equal(swapped["halved"], swapped["fp32"]),
                "moment_back": swapped["moment_back"] and plain["moment_back"],
                "set_peak": swapped["set_peak"], "gathered_peak": swapped["gathered_peak"],
                "rewritten": swapped["rewritten"],
            }
            del engine, swapper
    return results


@pytest.mark.timeout(240)
def test_nvme_state_is_read_one_parameter_at_a_time():
    for rank, result in enumerate(run_distributed(_worker, 2, timeout=200)):
        for stage, r in result.items():
            # the same values as without offload, which steps whole bucket shards (flat_step.py: within fp32 rounding)
            assert r["max_diff"] <= 1e-6, (rank, stage, r)
            assert r["fp32"] and r["exp_avg_sq"] and r["doubled"] and r["halved"] and r["moment_back"], (rank, stage, r)
            assert r["left"] == 0, (rank, stage, r)  # nothing stays read in
            # at most one parameter's master and two moments at once, a small part of the file
            assert 0 < r["peak"] <= r["bound"] < r["file"], (rank, stage, r)
            # pieces bigger than the 120-element tile are read a slice at a time, the state key asked for alone:
            # at most a tile's master and moments (a smaller piece read whole), not the largest piece's
            assert r["peak"] <= r["tile_bound"] < r["bound"], (rank, stage, r)
            # writing one parameter (safe_set_full_fp32_param, GatheredParameters with a modifier) reads in only
            # the masters it rewrites, not the file (what it did before: everything resident)
            for what in ("set_peak", "gathered_peak"):
                assert 0 < r[what] <= r["rewritten"] < r["file"] / 3, (rank, stage, what, r)
