"""The GPU tier (marker ``cuda``) of activation checkpoints: on CUDA, ``cpu_checkpointing`` (pinned host copies,
the copy stream, prefetch ahead of recomputation) and ``contiguous_memory_optimization`` give torch.utils.checkpoint's
gradients exactly, dropout included, and hold the checkpointed inputs off the GPU; the benchmark runs and saves
memory. Skipped where CUDA is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from zero_core import checkpointing

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cuda
BLOCKS = {
    "cpu": {"cpu_checkpointing": True},
    "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": 4},
    "cpu+contiguous": {"cpu_checkpointing": True, "contiguous_memory_optimization": True, "number_checkpoints": 4},
}


def _grads(layers, x, fn):
    layers.zero_grad()
    x.grad = None
    torch.manual_seed(1)
    h = x
    for layer in layers:
        h = fn(layer, h)
    h.square().sum().backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_checkpoint_fields_on_cuda_equal_torch_checkpoint(name):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.2), nn.GELU())
                            for _ in range(4)]).cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    expected = _grads(layers, x, lambda layer, h: torch_checkpoint.checkpoint(layer, h, use_reentrant=False))
    settings = checkpointing.configure(deepspeed_config={"activation_checkpointing": BLOCKS[name]})
    try:
        for step in range(2):
            for got, want in zip(_grads(layers, x, checkpointing.checkpoint), expected):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        stats = settings.stats
        assert stats.restored == stats.stashed == 2 * 4
        if settings.cpu:
            assert stats.host_bytes == stats.stashed_bytes == 2 * 4 * 512 * 256 * 4
            assert stats.prefetched == 2 * 3  # every input but the first recomputed comes back ahead of it
            assert all(b.data.is_pinned() for b in settings.buffers.values())
    finally:
        checkpointing.configure()


@pytest.mark.timeout(300)
def test_gpu_activation_checkpoints_benchmark_saves_the_inputs(tmp_path):
    out = tmp_path / "ac.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_activation_checkpoints", "--layers", "8",
                           "--hidden", "512", "--tokens", "4096", "--steps", "2", "--warmup", "1",
                           "--modes", "checkpoint", "cpu", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    result = json.loads(out.read_text())
    # All inputs but three: the caller's, the one recomputed first and the next, on its way back (10% slack).
    saved_at_least = (8 - 3) * 4096 * 512 * 2 / 2**20 * 0.9
    assert result["peak_saved_MiB"] >= saved_at_least, result
    assert result["cpu"]["prefetched"] > 0, result
