"""Peak host memory of NVMe offload (issue 38): the step holds a few tiles, not the whole state, and nothing
between steps.

One rank, stage 3, optimizer and parameters on NVMe, ``sub_group_size`` left at its default (1e9): the step's
tiles are capped (``NVME_TILE_NUMEL``, made one layer here so that the state is six tiles), at most three tiles
are read in at once (the one stepping, the next being read, the last being written), the swap keeps no buffer
after the step, and the weights are bit for bit those of the same training without offload. A buffer of 1 MiB or
more is the swap's own mapping, whose memory goes back to the OS when it is freed."""

from __future__ import annotations

import tempfile

import pytest
import torch

import zero_core
from distributed import run_distributed

WIDTH = 64
LAYER = WIDTH * WIDTH + WIDTH  # elements of one Linear layer: the capped tile


def _train(config: dict, steps: int, after_step=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(6)])
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    for step in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step))
        engine.backward(engine.module(x).square().mean())
        engine.step()
        if after_step is not None:
            after_step(engine)
    with zero_core.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.remove_offload_files()
    return weights


def _worker(rank: int, world_size: int) -> dict:
    from zero_core.offload import cpu_optimizer

    cpu_optimizer.NVME_TILE_NUMEL = LAYER  # a tile per layer, whatever sub_group_size says
    base = {"stage": 3, "param_persistence_threshold": 0}
    plain = _train(base, 3)
    held = []

    def after_step(engine) -> None:
        swapper = engine._offload.swapper
        held.append({"read_in": swapper.read_in_bytes, "kept": swapper._free_bytes,
                     "peak": swapper.peak_read_in_bytes})
        swapper.peak_read_in_bytes = 0

    with tempfile.TemporaryDirectory() as nvme_path:
        offload = {"device": "nvme", "nvme_path": nvme_path}
        swapped = _train({**base, "offload_optimizer": offload, "offload_param": {**offload, "max_in_cpu": 0}}, 3,
                         after_step)
    return {"held": held, "equal": all(torch.equal(a, b) for a, b in zip(plain, swapped))}


@pytest.mark.timeout(180)
def test_nvme_step_holds_a_few_tiles_and_nothing_after():
    (result,) = run_distributed(_worker, 1, timeout=150)
    assert result["equal"], result
    tile = LAYER * 4 * 3  # a layer's fp32 master and Adam's two moments
    for held in result["held"][1:]:  # from the second step on: the first creates Adam's state in memory
        assert held["read_in"] == 0 and held["kept"] == 0, result  # between steps the swap holds nothing
        assert 2 * tile <= held["peak"] <= 3 * tile, result  # of six tiles: the one stepping, one read, one written


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_large_swap_buffers_go_back_to_the_os_when_freed():
    from zero_core.offload.nvme_swap import MAPPED_BYTES, host_buffer

    nbytes = 64 * MAPPED_BYTES
    before = _rss_anon()
    buffer = host_buffer(nbytes)
    assert buffer.data_ptr() % 4096 == 0  # page-aligned, for the aio requests
    view = buffer.view(torch.float32)[1:]  # a tensor on part of it keeps all of it
    buffer.fill_(1)
    del buffer
    assert _rss_anon() - before >= nbytes * 9 // 10
    del view
    assert _rss_anon() - before <= nbytes // 10
    assert host_buffer(MAPPED_BYTES - 1).numel() == MAPPED_BYTES - 1  # small ones come from torch's allocator
