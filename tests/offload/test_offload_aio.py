"""The ``aio`` block's fields as the thread pool honours them (zero_core/offload/aio.py), observed at the
positioned write each request makes (``aio._pwrite``, wrapped): ``block_size`` cuts a tensor into requests of
that many bytes at aligned file offsets; ``thread_count`` threads run them; at most ``queue_depth`` ×
``thread_count`` are in the pool at once and submitting never blocks (the rest wait in a backlog);
``single_submit`` runs one transfer's requests one after another, in order; a full disk is an OSError naming
the nvme_path fields. The bytes written are the tensor's, whatever the field values."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from zero_core.offload import aio
from zero_core.offload.aio import AioPool, Transfer


class Recorder:
    """Wraps the positioned write: records each request and how many ran at once, optionally held at a gate."""

    def __init__(self, pool_of) -> None:
        self.requests: list[tuple[int, int, str]] = []  # (offset, bytes, thread name)
        self.running = self.most_running = self.most_in_pool = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.pool_of = pool_of  # the pool whose backlog accounting is checked

    def __call__(self, fd, view, offset) -> None:
        with self.lock:
            self.requests.append((offset, len(view), threading.current_thread().name))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.most_in_pool = max(self.most_in_pool, self.pool_of()._running)
        self.gate.wait(timeout=10)
        time.sleep(0.002)  # long enough for the other threads to start theirs
        with self.lock:
            self.running -= 1
        os.pwrite(fd, view, offset)


def pool_and_recorder(monkeypatch, **fields):
    settings = dict(block_size=256, queue_depth=2, thread_count=3, single_submit=False, overlap_events=True)
    settings.update(fields)
    holder: list[AioPool] = []
    recorder = Recorder(lambda: holder[0])
    monkeypatch.setattr(aio, "_pwrite", recorder)
    holder.append(AioPool(**settings))
    return holder[0], recorder


def written(fd: int, nbytes: int, offset: int = 0) -> bytes:
    return os.pread(fd, nbytes, offset)


def test_block_size_threads_and_queue_depth(monkeypatch, tmp_path):
    pool, recorder = pool_and_recorder(monkeypatch)
    fd = os.open(tmp_path / "swap", os.O_RDWR | os.O_CREAT)
    tensor = torch.arange(250, dtype=torch.float32)  # 1000 bytes: 3 requests of 256 and one of 232
    recorder.gate.clear()  # hold every request: submitting must still return at once
    transfers = []
    start = time.perf_counter()
    for index in range(5):
        transfer = Transfer()
        pool.write(transfer, fd, tensor, index * 1024)
        transfers.append(transfer)
    assert time.perf_counter() - start < 1.0 and not any(t.done() for t in transfers)
    with pool._lock:
        in_pool, backlog = pool._running, len(pool._backlog)
    assert in_pool == 2 * 3 and backlog == 5 * 4 - 6  # queue_depth x thread_count in the pool, the rest waiting
    recorder.gate.set()
    for transfer in transfers:
        transfer.wait()
    offsets = sorted(offset for offset, _, _ in recorder.requests)
    assert offsets == [i * 1024 + b for i in range(5) for b in (0, 256, 512, 768)]
    assert sorted({size for _, size, _ in recorder.requests}) == [232, 256]
    assert recorder.most_running <= 3 and recorder.most_in_pool <= 6
    assert len({name for *_, name in recorder.requests}) == 3 and all(
        name.startswith("zero-aio") for *_, name in recorder.requests)
    for index in range(5):
        assert written(fd, 1000, index * 1024) == tensor.numpy().tobytes()
    pool.close()
    os.close(fd)


def test_single_submit_runs_a_transfers_requests_in_order(monkeypatch, tmp_path):
    pool, recorder = pool_and_recorder(monkeypatch, single_submit=True, block_size=128, thread_count=4)
    fd = os.open(tmp_path / "swap", os.O_RDWR | os.O_CREAT)
    tensor = torch.randn(300)  # 1200 bytes: 10 requests
    transfer = Transfer()
    pool.write(transfer, fd, tensor, 0)
    transfer.wait()
    assert [offset for offset, *_ in recorder.requests] == list(range(0, 1200, 128))
    assert recorder.most_running == 1
    assert written(fd, 1200) == tensor.numpy().tobytes()
    pool.close()
    os.close(fd)


def test_a_full_disk_names_the_nvme_path_fields(monkeypatch, tmp_path):
    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    pool = AioPool(block_size=64, queue_depth=1, thread_count=1, single_submit=False, overlap_events=True)
    fd = os.open(tmp_path / "swap", os.O_RDWR | os.O_CREAT)
    transfer = Transfer()
    pool.write(transfer, fd, torch.zeros(64), 0)
    with pytest.raises(OSError, match="filled its disk.*offload_optimizer.nvme_path / offload_param.nvme_path"):
        transfer.wait()
    pool.close()
    os.close(fd)
