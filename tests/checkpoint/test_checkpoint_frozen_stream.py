"""A stage 3 checkpoint of a model whose frozen base is most of it (LoRA, a frozen backbone): the frozen
parameters are gathered, written and released one unit at a time, never all at once on a rank.

Two ranks, stage 3: 16 frozen Linear(1024, 1024) layers (64 MiB in fp32, each rank holding half) under a small
trainable head. A thread samples the process's resident anonymous memory while ``save_checkpoint`` runs; holding
the frozen base whole (what saving did before: a copy of every frozen parameter, then the write) raises it by the
whole 64 MiB, streaming by about a layer. The checkpoint then loads into a model built from other weights, and a
replicated file that fails to write half-way stops every rank with the error (the other ranks wait in the
gathers that rank 0 no longer asks for unless it walks them to the end)."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

LAYERS, WIDTH = 16, 1024
FROZEN_BYTES = LAYERS * WIDTH * WIDTH * 4


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    base = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    base.requires_grad_(False)
    return torch.nn.Sequential(base, torch.nn.Linear(WIDTH, 4))


def _engine(seed: int):
    import zero_core

    model = _model(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {"stage": 3, "param_persistence_threshold": 0}
    return zero_core.setup(model, torch.optim.AdamW(trainable, lr=1e-2), config)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _peak_rise(fn) -> int:
    """The highest resident anonymous memory while ``fn()`` runs, above what it was before (sampled each ms)."""
    before, peak, done = _rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], _rss_anon()) - before


def _worker(rank: int, world_size: int, directory: str) -> dict:
    from zero_core import GatheredParameters
    from zero_core.checkpoint import load_checkpoint, save_checkpoint
    from zero_core.checkpoint import save as save_module

    engine = _engine(seed=0)
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine.module(x).square().mean())
    engine.step()
    path = Path(directory) / "ckpt"
    rises = [_peak_rise(lambda: save_checkpoint(engine, path)) for _ in range(2)]  # the second: a warm heap

    other = _engine(seed=1)
    load_checkpoint(other, path)
    with GatheredParameters(list(engine.module.parameters()) + list(other.module.parameters())):
        equal = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), other.module.parameters()))

    original = save_module.write_safetensors

    def failing(file, entries, metadata=None, data=None):  # rank 0's replicated file: disk full after one layer
        if Path(file).name != save_module.REPLICATED:
            return original(file, entries, metadata, data)
        next(iter(data))
        raise OSError(28, "No space left on device")

    save_module.write_safetensors = failing
    try:
        save_checkpoint(engine, Path(directory) / "full_disk")
        failed = None
    except Exception as error:  # noqa: BLE001 - what each rank was told
        failed = f"{type(error).__name__}: {error}"
    finally:
        save_module.write_safetensors = original
    return {"rises": rises, "equal": equal, "failed": failed}


@pytest.mark.timeout(240)
def test_frozen_parameters_are_saved_one_unit_at_a_time_and_load_back():
    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_worker, 2, directory, timeout=200)
        assert not (Path(directory) / "full_disk").exists()  # the failed save published nothing
    for rank, result in enumerate(results):
        assert result["equal"], (rank, result)
        # a layer is 4 MiB (gathered, and the gather's buffers); holding the frozen base rose by 130 MB on rank 0
        assert min(result["rises"]) < FROZEN_BYTES // 4, (rank, result["rises"], FROZEN_BYTES)
        assert result["failed"] is not None and "No space left on device" in result["failed"], (rank, result)
