"""Checkpoints of offloaded engines: saved with the masters and state on the CPU or in NVMe files, they load
into an engine without offload (and the other way round, into CPU and NVMe placements, at another stage, and
from 2 ranks into 1 and from 1 into 2), and training continues exactly as the engine that saved them would have.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import EngineDriver, make_optimizer, train_loop
from stage3_support import full_params, max_abs_diff

BEFORE, AFTER = 3, 3
SMALL = {"reduce_bucket_size": 100, "allgather_bucket_size": 100, "sub_group_size": 120,
         "param_persistence_threshold": 0}


class _NoScheduler:
    def step(self) -> None:
        pass


def _config(stage: int, device: str, nvme_dir: str) -> dict:
    """``device``: where offload_optimizer puts the optimizer; "nvme+params": stage 3's parameter shards in a
    file too (ZeRO-Infinity)."""
    config = {"stage": stage, **SMALL}
    if device == "nvme+params":
        device = "nvme"
        config["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, "buffer_count": 2}
    if device != "none":
        config["offload_optimizer"] = {"device": device, **({"nvme_path": nvme_dir} if device == "nvme" else {})}
    return config


def _train(engine, first_step: int, steps: int) -> None:
    rank = dist.get_rank()
    batches = lambda step, micro: make_batch("transformer", rank, first_step + step, micro)  # noqa: E731
    train_loop(EngineDriver(engine), _NoScheduler(), batches, steps, accumulation=2, clip=0.5)


def _engine(stage: int, device: str, nvme_dir: str):
    model = build_model("transformer", seed=1)  # other initial weights than the saver's: the load must set them
    return zero_core.setup(model, make_optimizer(model), _config(stage, device, nvme_dir))


def checkpoint_worker(rank, world_size, pairs):
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-offload-ckpt-{rank}-")
    ckpt_root = tempfile.mkdtemp(prefix="zero-offload-ckpt-") if rank == 0 else None
    holder = [ckpt_root]
    dist.broadcast_object_list(holder, src=0)
    diffs = []
    for index, (saver, loader) in enumerate(pairs):
        path = os.path.join(holder[0], f"ckpt{index}")
        source = _engine(*saver, nvme_dir)
        _train(source, 0, BEFORE)
        source.save_checkpoint(path)
        weights = full_params(source.module)  # a collective at stage 3
        if rank == 0:  # what any other world size must load (test_load_at_another_world_size)
            torch.save(weights, os.path.join(holder[0], f"weights{index}.pt"))
        target = _engine(*loader, nvme_dir)
        target.load_checkpoint(path)
        loaded = max_abs_diff(full_params(target.module), full_params(source.module))
        # The debugging API reads NVMe-swapped state too (each call swaps it in and out again).
        params = [dict(e.module.named_parameters()) for e in (source, target)]
        state = zero_core.safe_get_full_optimizer_state
        loaded = max([loaded] + [(state(params[0][n], "exp_avg_sq") - state(params[1][n], "exp_avg_sq")).abs().max()
                                 .item() for n in ("blocks.0.fc1.weight", "tok.weight")])
        _train(source, BEFORE, AFTER)
        _train(target, BEFORE, AFTER)
        diffs.append((loaded, max_abs_diff(full_params(target.module), full_params(source.module))))
        for engine in (source, target):
            engine.remove_offload_files()
    return diffs, os.listdir(nvme_dir), holder[0]


def save_alone_worker(rank, world_size, root, placement):
    """One rank trains and saves (``ckptalone``) with ``placement``; its full weights go to ``weightsalone.pt``."""
    nvme_dir = tempfile.mkdtemp(prefix="zero-offload-alone-")
    engine = _engine(*placement, nvme_dir)
    _train(engine, 0, BEFORE)
    engine.save_checkpoint(os.path.join(root, "ckptalone"))
    torch.save(full_params(engine.module), os.path.join(root, "weightsalone.pt"))
    engine.remove_offload_files()
    os.rmdir(nvme_dir)


def other_world_size_worker(rank, world_size, root, index, placement):
    """A checkpoint saved by 2 ranks loads into 1 (or the other way round) with the optimizer offloaded."""
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-offload-ws-{rank}-")
    engine = _engine(*placement, nvme_dir)
    engine.load_checkpoint(os.path.join(root, f"ckpt{index}"))
    diff = max_abs_diff(full_params(engine.module), torch.load(os.path.join(root, f"weights{index}.pt")))
    with engine.offload_resident():
        state = zero_core.safe_get_full_optimizer_state(dict(engine.module.named_parameters())["tok.weight"],
                                                        "exp_avg_sq")
    _train(engine, BEFORE, 1)
    engine.remove_offload_files()
    return diff, float(state.abs().sum()), os.listdir(nvme_dir)


PAIRS = [
    ((3, "nvme"), (2, "none")),  # NVMe-offloaded stage 3 -> plain stage 2
    ((2, "cpu"), (3, "none")),
    ((1, "none"), (2, "cpu")),  # plain -> offloaded
    ((2, "none"), (3, "nvme")),
    ((2, "nvme"), (1, "cpu")),  # NVMe -> CPU
    ((3, "nvme+params"), (2, "none")),  # parameters in a file too
    ((1, "none"), (3, "nvme+params")),
    ((2, "cpu"), (3, "nvme+params")),  # CPU -> NVMe, parameters included
]


@pytest.fixture(scope="module")
def saved():
    return run_distributed(checkpoint_worker, 2, PAIRS, timeout=240)


@pytest.mark.timeout(300)
def test_offloaded_checkpoints_load_into_other_placements(saved):
    per_rank = saved
    for rank, (diffs, leftovers, _) in enumerate(per_rank):
        assert leftovers == [], f"rank {rank}: swap files left behind: {leftovers}"
        for (saver, loader), (loaded, trained) in zip(PAIRS, diffs, strict=True):
            assert loaded == 0.0, f"rank {rank} {saver} -> {loader}: loaded weights differ by {loaded}"
            # The same fp32 arithmetic on both sides, up to float reordering between stages' buckets.
            assert trained <= 1e-6, f"rank {rank} {saver} -> {loader}: {AFTER} steps on they differ by {trained}"


@pytest.mark.timeout(300)
def test_load_at_another_world_size(saved):
    root = saved[0][2]
    index = PAIRS.index(((3, "nvme+params"), (2, "none")))  # saved by 2 ranks with everything on NVMe
    (diff, state, leftovers), = run_distributed(other_world_size_worker, 1, root, index, (2, "nvme"), timeout=120)
    assert diff == 0.0 and state > 0 and leftovers == [], (diff, state, leftovers)


@pytest.mark.timeout(300)
def test_load_from_one_rank_into_two_with_everything_on_nvme(tmp_path):
    run_distributed(save_alone_worker, 1, str(tmp_path), (2, "cpu"), timeout=120)
    for rank, (diff, state, leftovers) in enumerate(
            run_distributed(other_world_size_worker, 2, str(tmp_path), "alone", (3, "nvme+params"), timeout=120)):
        assert diff == 0.0 and state > 0 and leftovers == [], (rank, diff, state, leftovers)
