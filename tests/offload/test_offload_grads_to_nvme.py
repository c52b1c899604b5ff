"""Gradient shards written to the swap file during backward (stages 2-3, ``offload_optimizer: nvme``): once a unit's
(stage 2: a reduce bucket's) reduced gradient is staged for its write, the accelerator's copy gives its memory back
(grad_memory.MovedToHost; on CUDA, forced on here on the CPU with ``RELEASE_ON_CPU``), keeping its bucket norms for
clipping and fp16's overflow check; the step reads each tile's gradients back from the file (nvme_grads.py). A
reader that needs the shard again gets the file's values copied back in.

Two ranks train the same steps twice in one process, with the shards written out and kept (the reference: the NVMe
step as it was, which the other offload tests hold against DDP), at each stage: bf16 with clipping from the config,
fp16 with a loss scale, fp32 (whose shards the step would otherwise read in place), a user's clip by the 1-norm (a
norm not kept: the shards come back from the file), accumulation by reducing backwards (the second reduction adds to
the values read back), two optimizers (the first one's step zeroes only its own gradients), every transfer waited at
once (``aio.overlap_events: false``), and at stage 3 with ``offload_param: nvme``, with the step overlapped with the
forward, and with a tile smaller than a piece (the piece's gradient is read slice by slice). Every loss, parameter
and master is bit for bit the reference's, so are the clip norms and a gradient read with the debugging API between
backward and step; after backward the shards hold no memory (and the reference's do), and the staging in flight
stays within its bound."""

from __future__ import annotations

import tempfile

import pytest
import torch

import zero_core
from distributed import run_distributed
from grads_moved import assert_trained_alike, train_steps
from models import build_model, make_batch
from reference import make_optimizer, make_scheduler

from zero_core import grad_memory

MODEL = "transformer"
STEPS = 3
SMALL = {"stage": 3, "reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8}}
CLIP = {"gradient_clipping": 0.05}
STAGE2 = {"stage": 2}  # several reduce buckets per group (reduce_bucket_size 300), each written on its own
RUNS = {
    "bf16, clipping": ({**BF16, **CLIP}, {}),
    "fp16, loss scale, clipping": ({**FP16, **CLIP}, {}),
    "fp32": ({}, {}),
    "bf16, a user's 1-norm clip": (BF16, {"clip_norm_type": 1.0}),
    "bf16, accumulation by reducing backwards": (BF16, {"micro": 2}),
    "bf16, offload_param nvme, clipping": ({**BF16, **CLIP, "offload_param": {"device": "nvme"}}, {}),
    "bf16, overlapped with the forward": (BF16, {"overlap": True}),
    "bf16, a tile smaller than a piece": ({**BF16, **CLIP}, {"tile": 64}),
    "bf16, two optimizers": (BF16, {"two": True}),
    "bf16, aio.overlap_events false, clipping": ({**BF16, **CLIP, "aio": {"overlap_events": False}}, {}),
    "bf16, buckets bigger than the staging bound": ({**BF16, **CLIP, "offload_optimizer": {"buffer_count": 1}},
                                                   {"tile": 16}),
    "stage 2, bf16, clipping": ({**STAGE2, **BF16, **CLIP}, {}),
    "stage 2, fp16, loss scale, clipping": ({**STAGE2, **FP16, **CLIP}, {}),
    "stage 2, fp32": (STAGE2, {}),
    "stage 2, bf16, accumulation by reducing backwards": ({**STAGE2, **BF16}, {"micro": 2}),
    "stage 2, bf16, two optimizers": ({**STAGE2, **BF16}, {"two": True}),
}


def train(rank: int, config: dict, moved: bool, nvme_path: str, micro: int = 1, overlap: bool = False,
          clip_norm_type: float = 0.0, tile: int = 0, two: bool = False) -> dict:
    from zero_core.offload import cpu_optimizer

    grad_memory.RELEASE_ON_CPU = moved  # this process only; the engine reads it as it sets up and steps
    default_tile = cpu_optimizer.NVME_TILE_NUMEL
    if tile:
        cpu_optimizer.NVME_TILE_NUMEL = tile
    model = build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    if two:  # the first optimizer's step zeroes its gradients only: the second's stay in the file until its own
        params = list(model.parameters())
        optimizer = [torch.optim.AdamW(params[: len(params) // 2], lr=1e-3),
                     torch.optim.SGD(params[len(params) // 2:], lr=1e-2, momentum=0.9)]
        scheduler = make_scheduler(optimizer[0])
    block = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, **config.get("offload_optimizer", {})}}
    config = {k: v for k, v in config.items() if k != "offload_optimizer"}
    if "offload_param" in config:
        config = {**config, "offload_param": {**config["offload_param"], "nvme_path": nvme_path}}
    engine = zero_core.setup(model, optimizer, {**block, **SMALL, **config})
    cpu_optimizer.NVME_TILE_NUMEL = default_tile
    engine._offload.overlap = True if overlap else None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(next((k for k in ("fp16", "bf16") if k in config), ""),
                                                                 torch.float32)
    result = train_steps(engine, MODEL, rank, STEPS, micro, dtype, scheduler, clip_norm_type)
    written = engine._offload.grads.nvme
    result.update({"written": written.buckets_written, "staged": written.pieces_staged,
                   "staging": written.peak_staging_bytes,
                   "bound": written.staging_bytes, "slices": engine._offload.slices_stepped,
                   "ahead": engine._offload.grads.read_ahead_pieces})
    engine.close()
    grad_memory.RELEASE_ON_CPU = False
    return result


def equivalence_worker(rank, world_size):
    with tempfile.TemporaryDirectory() as nvme_path:
        return {label: (train(rank, config, False, nvme_path, **options), train(rank, config, True, nvme_path,
                                                                                 **options))
                for label, (config, options) in RUNS.items()}


@pytest.mark.timeout(400)
def test_gradients_written_to_nvme_train_bit_for_bit_as_kept_ones():
    for rank, results in enumerate(run_distributed(equivalence_worker, 2, timeout=360)):
        for label, (kept, moved) in results.items():
            where = f"rank {rank}, {label}"
            assert_trained_alike(kept, moved, where, MODEL)
            assert kept["written"] == 0 and moved["written"] >= moved["moved"], where
            if label.startswith("stage 2"):  # a bucket per move; the one lent from the reducer's staging is not written
                assert moved["written"] == moved["moved"], (where, moved["written"], moved["moved"])
            assert 0 < moved["staging"] <= moved["bound"], (where, moved["staging"], moved["bound"])
            # read beside the tile's masters, ahead of its step (not when every transfer is waited at once; the
            # 1-norm clip brought every shard back from the file before the step)
            if "overlapped" not in label:  # (its thread reads whole parts' gradients; its first step is inline)
                expect_ahead = not any(word in label for word in ("overlap_events", "1-norm"))
                assert (moved["ahead"] > 0) == expect_ahead, (where, moved["ahead"])
            if "staging bound" in label:  # (12 bytes x 1 buffer x a 16-element tile: 96 bf16 elements a piece)
                assert moved["staged"] > moved["written"], (where, moved["staged"], moved["written"])
            if "tile smaller" in label:
                assert moved["slices"] > 0 and kept["slices"] > 0, (where, moved["slices"])


def full_disk_worker(rank, world_size):
    """One rank: a step, then the disk fills while backward writes the gradients."""
    import errno
    import os

    grad_memory.RELEASE_ON_CPU = True
    with tempfile.TemporaryDirectory() as nvme_path:
        model = build_model(MODEL)
        engine = zero_core.setup(model, make_optimizer(model), {
            **SMALL, **BF16, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}})
        batch = make_batch(MODEL, rank, 0, 0, dtype=torch.bfloat16)
        engine.backward(engine.module(*batch))
        engine.step()
        write = os.pwritev

        def full(fd, views, offset):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.pwritev = full
        try:
            engine.backward(engine.module(*batch))
            engine.step()
            error = None
        except OSError as raised:
            error = str(raised)
        finally:
            os.pwritev = write
        engine.close()  # does not raise again, nor hang
        left = os.listdir(nvme_path)
    grad_memory.RELEASE_ON_CPU = False
    return {"error": error, "left": left}


@pytest.mark.timeout(120)
def test_a_disk_that_fills_while_gradients_are_written_is_an_error_naming_the_path():
    (result,) = run_distributed(full_disk_worker, 1, timeout=100)
    assert result["error"] is not None and "filled its disk" in result["error"], result
    assert "offload_optimizer.nvme_path" in result["error"], result
    assert result["left"] == [], result  # the swap file is gone after close()
