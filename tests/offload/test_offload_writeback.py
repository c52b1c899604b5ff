"""``offload_param: {device: nvme}``: the write-back of parameter shards after the step runs on the aio threads.

One spawn of 2 ranks trains a chain of layers at stage 3 with every shard in the file (``max_in_cpu: 0``), the
optimizer offloaded to CPU memory, AdamW, 2-step accumulation and clipping, while each positioned write is slowed
by 20 ms (``aio._pwrite`` wrapped in the worker), so a write that is waited shows. With ``aio.overlap_events``:
every write-back after a step was still running when the training thread went on, some finished without the
training thread ever waiting for them, the thread waited less for writes in all than with ``overlap_events:
false`` (where each is waited on the spot), and the weights equal the engine's without offload exactly and
DDP's within 1e-5 either way; after a flush, the file holds each shard's latest values. A single-process test
checks that reading a shard whose write is in flight takes the written buffer.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

from distributed import run_distributed
from reference import train_ddp
from stage3_support import max_abs_diff, train_engine
from test_offload_readahead import Chain, chain_batch

STEPS = 3
WRITE_DELAY_S = 0.02


def config(nvme_dir: str | None, overlap: bool = True) -> dict:
    out = {"stage": 3, "param_persistence_threshold": 0, "gradient_accumulation_steps": 2}
    if nvme_dir is not None:
        out["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, "buffer_count": 4}
        out["offload_optimizer"] = {"device": "cpu"}
        out["aio"] = {"block_size": 512, "queue_depth": 2, "thread_count": 2, "overlap_events": overlap}
    return out


def file_matches_units(engine) -> bool:
    """Every shard's bytes in the file equal the unit's master cast to the shard dtype (read with os.pread)."""
    swap = engine.runtime.param_swap
    swap.flush()
    for unit in engine.runtime.units:
        if unit.swap is not swap:
            continue
        numel, dtype = unit.swapped_shard
        data = os.pread(swap.fd, numel * dtype.itemsize, swap._offset[id(unit)])
        in_file = torch.frombuffer(bytearray(data), dtype=dtype)
        expected = torch.cat([b.reshape(-1) for b in unit.master_shards.buckets]).to(dtype)  # all trainable
        if not torch.equal(in_file, expected[:numel]):
            return False
    return True


def worker(rank, world_size):
    from zero_core.offload import aio

    write = aio._pwrite

    def slow_write(fd, view, offset):  # a slow disk: a write that is waited costs 20 ms
        time.sleep(WRITE_DELAY_S)
        write(fd, view, offset)

    aio._pwrite = slow_write
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-writeback-{rank}-")
    ddp = train_ddp(Chain, chain_batch, STEPS, accumulation=2, clip=0.5)
    plain, _ = train_engine(Chain, chain_batch, config(None), STEPS, accumulation=2, clip=0.5)
    report = {}
    for overlap in (True, False):
        result, engine = train_engine(Chain, chain_batch, config(nvme_dir, overlap), STEPS, accumulation=2, clip=0.5)
        swap = engine.runtime.param_swap
        in_file = sum(unit.swap is swap for unit in engine.runtime.units)
        report[overlap] = {
            "same_as_plain": all(torch.equal(result.params[n], plain.params[n]) for n in plain.params),
            "ddp_diff": max_abs_diff(result.params, ddp.params),
            "in_file": in_file,
            "counters": {k: getattr(swap, k) for k in ("writes_async", "writes_in_flight", "writes_waited",
                                                       "reads_from_write", "reads_stale")},
            "write_wait_s": swap.write_wait_s,
            "file_matches": file_matches_units(engine),
        }
        engine.remove_offload_files()
    aio._pwrite = write
    report["left"] = os.listdir(nvme_dir)
    os.rmdir(nvme_dir)
    return report


@pytest.mark.timeout(300)
def test_param_nvme_write_back_overlaps_and_matches():
    for rank, report in enumerate(run_distributed(worker, 2, timeout=240)):
        assert report["left"] == [], report
        for overlap in (True, False):
            r = report[overlap]
            where = f"rank {rank}, overlap_events={overlap}"
            assert r["same_as_plain"], f"{where}: weights differ from the engine without offload"
            assert r["ddp_diff"] <= 1e-5, f"{where}: max |w - w_ddp| = {r['ddp_diff']:.3g}"
            assert r["file_matches"], f"{where}: the file does not hold the latest shard values"
            counters = r["counters"]
            assert r["in_file"] >= 2 and counters["writes_async"] >= STEPS * r["in_file"], r
            if overlap:  # every write-back left running, some never waited for
                assert counters["writes_in_flight"] == counters["writes_async"], f"{where}: {counters}"
                assert counters["writes_waited"] < counters["writes_async"], f"{where}: {counters}"
                assert r["write_wait_s"] < report[False]["write_wait_s"], (where, r, report[False])
            else:  # each waited on the spot: at least the injected delay per write
                assert counters["writes_in_flight"] == 0, f"{where}: {counters}"
                # (0.9: the wait starts a moment after the write's first request began its delay)
                assert r["write_wait_s"] >= 0.9 * WRITE_DELAY_S * counters["writes_async"], f"{where}: {r}"


def test_read_of_a_shard_being_written_takes_the_written_buffer(tmp_path):
    """resident() leaves the write running and keeps its buffer; reading that shard next waits for the write and
    returns the buffer with the new values (no file read); after a flush the file holds them."""
    from types import SimpleNamespace

    from test_offload_readahead import FakeUnit
    from zero_core.offload.param_swap import ParamSwap

    block = SimpleNamespace(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, pin_memory=False)
    aio = SimpleNamespace(block_size=32, queue_depth=2, thread_count=2, single_submit=False, overlap_events=True)
    units = [FakeUnit(shard=torch.full((40,), float(i)), module_name=f"m{i}", state=SimpleNamespace(value="sharded"),
                      swap=None, swapped_shard=None) for i in range(3)]
    swap = ParamSwap(block, aio, 0, [u.shard for u in units])
    for unit in units:
        swap.adopt(unit)
    for unit in units[:2]:  # both buffers go to writes in flight
        with swap.resident(unit):
            unit.shard.add_(10.0)
    assert swap.writes_async == 2 and unit.shard.numel() == 0
    read_before = swap.bytes_read
    assert torch.equal(swap.read(units[0]), torch.full((40,), 10.0)) and swap.reads_from_write == 1
    assert swap.bytes_read == read_before  # the write's buffer, not the file
    assert torch.equal(swap.read(units[2]), torch.full((40,), 2.0))  # the other write's buffer was waited, freed
    swap.release(units[0])
    swap.release(units[2])
    swap.flush()
    for index, unit in enumerate(units):
        data = os.pread(swap.fd, 160, swap._offset[id(unit)])
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32),
                           torch.full((40,), float(index) + (10.0 if index < 2 else 0.0))), unit.module_name
    swap.close()
    assert os.listdir(tmp_path) == []
