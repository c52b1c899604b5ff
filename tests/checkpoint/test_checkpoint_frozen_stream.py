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


def _engine(seed: int, stage: int = 3):
    import zero_core

    model = _model(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = {"stage": stage, "param_persistence_threshold": 0}
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


def _excluding_worker(rank: int, world_size: int, directory: str, stage: int) -> dict:
    import json

    from zero_core import GatheredParameters
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    engine = _engine(seed=0, stage=stage)
    x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine.module(x).square().mean())
    engine.step()
    frozen_gathers = []
    if stage == 3:  # count the gathers of frozen units from here on
        gather = engine.runtime._gather

        def counting(unit, *args, **kwargs):
            if not unit.trainable:
                frozen_gathers.append(unit)
            return gather(unit, *args, **kwargs)

        engine.runtime._gather = counting
    path = Path(directory) / f"lora{stage}"
    save_checkpoint(engine, path, exclude_frozen_parameters=True)
    states = [engine.full_state_dict(masters=m, exclude_frozen_parameters=True) for m in (True, False)]
    gathered_frozen = len(frozen_gathers)

    resumed = _engine(seed=0, stage=stage)  # the same base, as from the pretrained files; another head
    with GatheredParameters(list(resumed.module[1].parameters()), modifier_rank=0):
        torch.nn.init.normal_(resumed.module[1].weight)
    load_checkpoint(resumed, path)  # strict: the base is left out on purpose, not missing
    with GatheredParameters(list(engine.module.parameters()) + list(resumed.module.parameters())):
        equal = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), resumed.module.parameters()))
        head = {k: v.detach().clone() for k, v in engine.module[1].state_dict().items()}
    manifest = json.loads((path / "manifest.json").read_text())
    return {"equal": equal, "gathered_frozen": gathered_frozen, "manifest": manifest,
            "keys": [sorted(s) for s in states], "head": head, "states": states,
            "bytes": sum(f.stat().st_size for f in path.iterdir())}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
def test_exclude_frozen_parameters_leaves_the_base_out_ungathered_and_resumes(stage, capsys):
    from safetensors.torch import load_file

    from zero_core.checkpoint import consolidate
    from zero_core.checkpoint.cli import main

    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_excluding_worker, 2, directory, stage, timeout=200)
        path = Path(directory) / f"lora{stage}"
        main(["inspect", str(path)])
        said = capsys.readouterr().out
        consolidated = consolidate(path, Path(directory) / "out", progress=False)
        keys = sorted(k for f in consolidated.glob("*.safetensors") for k in load_file(f))
    assert f"frozen parameters left out (exclude_frozen_parameters): {LAYERS} (0.0.weight" in said, said
    assert keys == ["1.bias", "1.weight"]  # consolidation gives what was trained
    base = [f"0.{i}.weight" for i in range(LAYERS)]
    for rank, result in enumerate(results):
        assert result["equal"], rank  # the head loaded, the base kept as the model had it
        assert result["gathered_frozen"] == 0, result["gathered_frozen"]  # at stage 3: nothing of the base moved
        assert sorted(result["manifest"]["excluded_frozen_parameters"]) == sorted(base)
        assert result["manifest"]["replicated"] == []
        assert result["bytes"] < FROZEN_BYTES // 16, result["bytes"]  # the head and its Adam state only
    states, head = results[0]["states"], results[0]["head"]
    for state in states:  # on rank 0: the head alone, its masters (fp32 here) and the model's own values alike
        assert sorted(state) == ["1.bias", "1.weight"]
        assert all(torch.equal(state[f"1.{k}"], head[k]) for k in ("weight", "bias"))
    assert results[1]["states"] == [{}, {}]
