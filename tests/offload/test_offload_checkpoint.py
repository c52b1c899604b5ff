"""Checkpoints of offloaded engines: saved with the masters and state on the CPU or in NVMe files, they load
into an engine without offload (and the other way round, into CPU and NVMe placements, at another stage, and
from 2 ranks into 1 and from 1 into 2), and training continues exactly as the engine that saved them would have.
With NVMe the state passes through memory a few tiles at a time, on save and on load (the swapper's peak of
bytes read in stays within two tiles, pieces bigger than a tile streamed in slices); saves and loads go through the
module-level functions Lightning's and Accelerate's checkpoint IO call.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

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


def _swapper(engine):
    offload = engine._offload
    return offload.swapper if offload is not None else None


def _measured(engine, action, released: bool = True):
    """Run ``action``; with NVMe, (peak bytes read in from the swap file, bytes in the file, two tiles' bytes)."""
    swapper = _swapper(engine)
    if swapper is None:
        action()
        return None
    swapper.peak_read_in_bytes = swapper.read_in_bytes
    action()
    assert swapper.read_in_bytes == 0 or not released, swapper.read_in_bytes  # everything released again
    total = sum(shape.numel() * dtype.itemsize for shape, dtype in swapper._shapes.values())
    bytes_per_element = 4 * 3  # fp32 master and Adam's two moments
    tile = engine.config.sub_group_size
    return swapper.peak_read_in_bytes, total, 2 * tile * bytes_per_element


def checkpoint_worker(rank, world_size, pairs):
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-offload-ckpt-{rank}-")
    ckpt_root = tempfile.mkdtemp(prefix="zero-offload-ckpt-") if rank == 0 else None
    holder = [ckpt_root]
    dist.broadcast_object_list(holder, src=0)
    diffs, peaks = [], []
    for index, (saver, loader) in enumerate(pairs):
        path = os.path.join(holder[0], f"ckpt{index}")
        source = _engine(*saver, nvme_dir)
        _train(source, 0, BEFORE)
        saved = _measured(source, lambda: zero_core.save_checkpoint(source, path))
        weights = full_params(source.module)  # a collective at stage 3
        if rank == 0:  # what any other world size must load (test_load_at_another_world_size)
            torch.save(weights, os.path.join(holder[0], f"weights{index}.pt"))
        target = _engine(*loader, nvme_dir)
        loaded_peak = _measured(target, lambda: zero_core.load_checkpoint(target, path))
        if saved is not None:  # contrast: everything resident at once, as checkpoints did before
            context = source.offload_resident()
            resident = _measured(source, context.__enter__, released=False)
            context.__exit__(None, None, None)
        peaks.append({"save": saved, "load": loaded_peak, "resident": resident if saved is not None else None})
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
    return diffs, os.listdir(nvme_dir), holder[0], peaks


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
    for rank, (diffs, leftovers, *_) in enumerate(per_rank):
        assert leftovers == [], f"rank {rank}: swap files left behind: {leftovers}"
        for (saver, loader), (loaded, trained) in zip(PAIRS, diffs, strict=True):
            assert loaded == 0.0, f"rank {rank} {saver} -> {loader}: loaded weights differ by {loaded}"
            # The same fp32 arithmetic on both sides, up to float reordering between stages' buckets.
            assert trained <= 1e-6, f"rank {rank} {saver} -> {loader}: {AFTER} steps on they differ by {trained}"


@pytest.mark.timeout(300)
def test_nvme_checkpoints_stream_tile_by_tile(saved):
    """Saving reads each tile of masters and state from the swap file, writes it, and drops it; loading reads a
    tile's masters, fills them and the state, and writes the tile out: at most two tiles (the one in use and
    the one read ahead) are in memory, where holding everything resident reads all of the file in. This
    model's largest pieces are bigger than the 120-element tile and a quarter of a rank's state: they pass
    through a slice at a time (piece_in_file.py). test_streamed_checkpoint_of_many_tiles has many tiles."""
    counts = {"save": 0, "load": 0}
    for rank, (*_, peaks) in enumerate(saved):
        for (saver, loader), peak in zip(PAIRS, peaks, strict=True):
            for what in ("save", "load"):
                if peak[what] is not None:
                    read_in, total, two_tiles = peak[what]
                    assert 0 < read_in <= two_tiles and read_in < total / 2, (rank, saver, loader, what, peak[what])
                    counts[what] += rank == 0
            if peak["resident"] is not None:
                read_in, total, _ = peak["resident"]
                assert read_in == total, (rank, saver, loader, peak["resident"])
    assert counts == {"save": 3, "load": 3}, counts


class _Stack(nn.Module):
    """24 small layers: a rank's state is many tiles."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(24)])

    def forward(self, x):
        return self.layers(x).pow(2).mean()


def _stack_engine(stage: int, nvme_dir: str, seed: int, tile: int = 300):
    model = _Stack(seed)
    config = {"stage": stage, "sub_group_size": tile, "param_persistence_threshold": 0,
              "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}}
    return zero_core.setup(model, make_optimizer(model), config)


def _stack_steps(engine, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine.module(x))
        engine.step()
        if not engine.step_zeroes_grads:
            engine.zero_grad()


def streamed_worker(rank, world_size, root):
    nvme_dir = tempfile.mkdtemp(prefix="zero-offload-stream-")
    out = {}
    for stage in (2, 3):
        path = os.path.join(root, f"stack{stage}")
        source = _stack_engine(stage, nvme_dir, 0)
        _stack_steps(source, 0, 3)
        save = _measured(source, lambda: zero_core.save_checkpoint(source, path))
        target = _stack_engine(stage, nvme_dir, 1)
        load = _measured(target, lambda: zero_core.load_checkpoint(target, path))
        params = [dict(e.module.named_parameters()) for e in (source, target)]
        state = max((zero_core.safe_get_full_optimizer_state(params[0][n], key)
                     - zero_core.safe_get_full_optimizer_state(params[1][n], key)).abs().max().item()
                    for n in params[0] for key in ("exp_avg", "exp_avg_sq"))
        weights = max_abs_diff(full_params(target.module), full_params(source.module))
        _stack_steps(source, 3, 2)
        _stack_steps(target, 3, 2)
        trained = max_abs_diff(full_params(target.module), full_params(source.module))
        out[stage] = {"save": save, "load": load, "state": state, "weights": weights, "trained": trained}
        for engine in (source, target):
            engine.remove_offload_files()
    return out


@pytest.mark.timeout(200)
def test_streamed_checkpoint_of_many_tiles(tmp_path):
    """A rank whose state is about 20 tiles: a save and a load each hold at most two tiles of it (a tenth), and
    the round trip gives the same weights and Adam state, and the same training afterwards (stages 2 and 3)."""
    out, = run_distributed(streamed_worker, 1, str(tmp_path), timeout=180)
    for stage, got in out.items():
        assert got["weights"] == 0.0 and got["state"] == 0.0 and got["trained"] == 0.0, (stage, got)
        for what in ("save", "load"):
            read_in, total, two_tiles = got[what]
            assert 0 < read_in <= two_tiles <= total / 8, (stage, what, got[what])


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


def interrupted_worker(rank, world_size, root):
    """A save and a load that fail in the middle of a piece streamed a slice at a time (piece_in_file.py): the
    slices are given back, nothing is left read in, and the engine saves, loads and trains on as if they had not
    been tried."""
    from zero_core.checkpoint import files, sources

    nvme_dir = tempfile.mkdtemp(prefix="zero-offload-interrupted-")
    # tiles of 100 elements: each Linear weight's piece (256) is three slices
    source, target = (_stack_engine(3, nvme_dir, seed, tile=100) for seed in (0, 1))
    _stack_steps(source, 0, 2)
    swapper = _swapper(source)
    path = os.path.join(root, "interrupted")
    real_bytes, calls = files.tensor_bytes, []

    def failing_bytes(tensor):
        calls.append(tensor.numel())
        if len(calls) == 2:  # the second slice of the first piece's master
            raise OSError("disk full (injected)")
        return real_bytes(tensor)

    files.tensor_bytes = failing_bytes
    try:
        with pytest.raises(OSError, match="injected"):
            zero_core.save_checkpoint(source, path)
    finally:
        files.tensor_bytes = real_bytes
    out = {"save_left": swapper.read_in_bytes, "slices_written": calls, "exists": os.path.exists(path)}
    zero_core.save_checkpoint(source, path)
    real_read, reads = sources.ShardedSource.read, []

    def failing_read(self, name, rng, kind="master"):
        reads.append(rng.size)
        if len(reads) == 2:
            raise OSError("read error (injected)")
        return real_read(self, name, rng, kind)

    sources.ShardedSource.read = failing_read
    try:
        with pytest.raises(OSError, match="injected"):
            zero_core.load_checkpoint(target, path)
    finally:
        sources.ShardedSource.read = real_read
    out["load_left"], out["slices_read"] = _swapper(target).read_in_bytes, reads
    zero_core.load_checkpoint(target, path)
    out["weights"] = max_abs_diff(full_params(target.module), full_params(source.module))
    _stack_steps(source, 2, 2)
    _stack_steps(target, 2, 2)
    out["trained"] = max_abs_diff(full_params(target.module), full_params(source.module))
    out["sliced"] = source._offload.slices_stepped > 0
    for engine in (source, target):
        engine.remove_offload_files()
    return out


@pytest.mark.timeout(200)
def test_interrupted_save_and_load_of_a_sliced_piece_leave_nothing_behind(tmp_path):
    out, = run_distributed(interrupted_worker, 1, str(tmp_path), timeout=180)
    assert out["slices_written"] == [100, 100], out  # the first piece's first slice, and the one that failed
    assert out["slices_read"] == [100, 100], out
    assert out["save_left"] == 0 and not out["exists"] and out["load_left"] == 0, out
    assert out["weights"] == 0.0 and out["trained"] == 0.0 and out["sliced"], out
