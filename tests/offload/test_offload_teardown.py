"""The engine's teardown (``engine.close()``, what every front-end calls when training ends) takes the NVMe swap
files out of ``nvme_path`` and stops the offload threads, also when the block ends with an exception; the engine
stays usable (it trains on to the same weights as an engine without offload, and saves), and
``remove_offload_files`` then frees the files' space. tests/lightning/test_lightning_offload_fit.py checks the same
after a real ``Trainer.fit``."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import EngineDriver, make_optimizer, train_loop
from stage3_support import full_params, max_abs_diff

SMALL = {"reduce_bucket_size": 100, "allgather_bucket_size": 100, "sub_group_size": 120,
         "param_persistence_threshold": 0}
OFFLOAD_THREADS = ("zero-aio", "zero-offload")


class _NoScheduler:
    def step(self) -> None:
        pass


def _config(nvme_dir: str, offload: bool = True) -> dict:
    config = {"stage": 3, **SMALL}
    if offload:
        config["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        config["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, "buffer_count": 2}
    return config


def _engine(nvme_dir: str, offload: bool = True):
    model = build_model("transformer")
    return zero_core.setup(model, make_optimizer(model), _config(nvme_dir, offload))


def _train(engine, first_step: int, steps: int) -> None:
    rank = dist.get_rank()
    batches = lambda step, micro: make_batch("transformer", rank, first_step + step, micro)  # noqa: E731
    train_loop(EngineDriver(engine), _NoScheduler(), batches, steps, accumulation=2, clip=0.5)


def _offload_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(OFFLOAD_THREADS))


def teardown_worker(rank, world_size):
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-offload-teardown-{rank}-")
    report = {}
    engine = _engine(nvme_dir)
    _train(engine, 0, 2)
    report["files_training"] = sorted(f.split("_")[1] for f in os.listdir(nvme_dir))
    report["threads_training"] = bool(_offload_threads())
    engine.close()
    report["files_closed"] = os.listdir(nvme_dir)
    report["threads_closed"] = _offload_threads()
    fds = [engine._offload.swapper.fd, engine.runtime.param_swap.fd]
    report["links_closed"] = [os.fstat(fd).st_nlink for fd in fds]  # unlinked, still open
    _train(engine, 2, 2)  # the engine trains on from the open files after its teardown
    reference = _engine(nvme_dir, offload=False)
    _train(reference, 0, 4)
    report["diff"] = max_abs_diff(full_params(engine.module), full_params(reference.module))
    checkpoints = tempfile.mkdtemp(prefix=f"zero-offload-teardown-ckpt-{rank}-")
    engine.save_checkpoint(os.path.join(checkpoints, "ckpt"))  # and saves
    shutil.rmtree(checkpoints)
    engine.close()  # again: idempotent
    report["files_closed_again"] = os.listdir(nvme_dir)
    engine.remove_offload_files()
    report["fds_open_after_remove"] = [_is_open(fd) for fd in fds]
    try:
        with _engine(nvme_dir) as failing:
            _train(failing, 0, 1)
            report["files_in_block"] = len(os.listdir(nvme_dir))
            raise RuntimeError("a failure inside the block")
    except RuntimeError:
        pass
    report["files_after_exception"] = os.listdir(nvme_dir)
    report["threads_after_exception"] = _offload_threads()
    failing.remove_offload_files()
    os.rmdir(nvme_dir)
    return report


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.timeout(200)
def test_close_removes_swap_files_and_threads_and_the_engine_still_trains():
    report, = run_distributed(teardown_worker, 1, timeout=180)
    assert report["files_training"] == ["offload", "params"] and report["threads_training"], report
    assert report["files_closed"] == [] and report["threads_closed"] == [], report
    assert report["links_closed"] == [0, 0], report
    assert report["diff"] <= 1e-6, report  # the same fp32 arithmetic as without offload
    assert report["files_closed_again"] == [] and report["fds_open_after_remove"] == [False, False], report
    assert report["files_in_block"] == 2, report
    assert report["files_after_exception"] == [] and report["threads_after_exception"] == [], report
