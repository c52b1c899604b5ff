"""The multi-process harness itself: ordering, failures, hangs, clean-up."""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import RankFailed, run_distributed


def report_rank(rank, world_size, offset, *, scale):
    # Rank 0 answers last, so results that arrive out of order must be put back in order.
    time.sleep(0.2 * (world_size - rank))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "value": torch.full((2,), float(rank * scale + offset)),
        "total": total.item(),
    }


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on this rank")
    dist.barrier()  # rank 0 waits for a peer that never comes


def hang_on_rank_one(rank, world_size, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))  # rank 0 hangs here waiting for rank 1


def exit_silently_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def report_environment_then_change_state(rank, world_size):
    seen = {"value": os.environ.get("ZERO_HARNESS_VALUE"), "dtype": torch.get_default_dtype()}
    torch.set_default_dtype(torch.float64)  # a later run's ranks must not inherit this
    return seen


def assert_no_children():
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
def test_results_come_back_in_rank_order():
    results = run_distributed(report_rank, 3, 10.0, scale=2.0, timeout=90)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["dist_rank"] for r in results] == [0, 1, 2]
    for rank, result in enumerate(results):
        assert result["world_size"] == 3
        assert result["backend"] == "gloo"
        assert result["threads"] == 1
        assert torch.equal(result["value"], torch.full((2,), rank * 2.0 + 10.0))
        assert result["total"] == 0 + 1 + 2
    assert_no_children()


@pytest.mark.timeout(120)
def test_each_rank_starts_fresh_with_the_environment_as_of_its_start(monkeypatch):
    """Ranks are forks of a server that imported torch once: each still takes the parent's environment as it is
    when the rank starts (not as it was when the server started) and none of an earlier rank's state."""
    monkeypatch.setenv("ZERO_HARNESS_VALUE", "first")
    first = run_distributed(report_environment_then_change_state, 2, timeout=90)
    monkeypatch.setenv("ZERO_HARNESS_VALUE", "second")
    second = run_distributed(report_environment_then_change_state, 2, timeout=90)
    monkeypatch.delenv("ZERO_HARNESS_VALUE")
    third = run_distributed(report_environment_then_change_state, 2, timeout=90)
    for run, value in ((first, "first"), (second, "second"), (third, None)):
        assert [seen["value"] for seen in run] == [value, value], run
        assert [seen["dtype"] for seen in run] == [torch.float32, torch.float32], run
    assert_no_children()


@pytest.mark.timeout(120)
def test_exception_names_the_rank_and_carries_its_traceback():
    with pytest.raises(RankFailed) as failure:
        run_distributed(fail_on_rank_one, 2, timeout=90)
    assert failure.value.rank == 1
    message = str(failure.value)
    assert "rank 1" in message
    assert "ValueError: deliberate failure on this rank" in message
    assert "fail_on_rank_one" in message  # the remote traceback, not just the message
    assert_no_children()


@pytest.mark.timeout(120)
def test_a_rank_that_exits_without_a_result_is_reported():
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        run_distributed(exit_silently_on_rank_one, 2, timeout=90)
    assert_no_children()


@pytest.mark.timeout(180)
def test_timeout_kills_every_rank_and_names_them(tmp_path):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running"):
        run_distributed(hang_on_rank_one, 2, str(tmp_path), timeout=15)  # (ranks fork from a warm server)
    assert time.monotonic() - started < 120
    assert_no_children()
    for rank in (0, 1):
        pid = int((tmp_path / f"{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_local_functions_are_refused_before_spawning():
    def local(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level"):
        run_distributed(local, 2)
