"""Run a function on several CPU processes joined by a gloo process group.

A fresh interpreter costs seconds here (importing torch and zero_core), so ranks are forked from one server process
that imported them once (multiprocessing's forkserver, started on first use); a rank's start still costs its test
module's own imports and the process group's rendezvous, so tests should loop over many configurations inside one
call of `run_distributed` rather than launch once per configuration.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import time
import traceback
from datetime import timedelta
from multiprocessing import get_context
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from launch import free_port

SEED = 1234
# What the fork server imports once for every rank it forks
PRELOAD = ["torch", "torch.distributed", "zero_core"]
# How long a finished rank may take to exit (destroying its group) before it is killed.
EXIT_GRACE_S = 10.0


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""

    def __init__(self, rank: int, remote_traceback: str):
        super().__init__(f"rank {rank} raised:\n{remote_traceback}")
        self.rank = rank


def run_distributed(fn, world_size: int, *args, timeout: float = 120, nodes: int = 1, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` fresh processes.

    `nodes` > 1 simulates that many machines of `world_size / nodes` ranks each: every process gets the
    environment a launcher gives a multi-node run (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK as torchrun sets
    them), numbered node by node.

    Returns each rank's (picklable) return value in rank order. Raises `RankFailed` with the
    traceback of the first rank that raised, or `TimeoutError` naming the ranks still running after
    `timeout` seconds (counted from the start). Every process is gone when this returns or raises.
    """
    _check_importable(fn)
    context = _context()
    port = free_port()
    ranks = []
    finished = False
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker,
                args=(fn, rank, world_size, port, timeout, sender, args, kwargs, nodes, dict(os.environ)),
                name=f"rank{rank}",
                daemon=True,
            )
            process.start()
            sender.close()  # the child holds its own copy; ours would hide the child's exit
            ranks.append((process, receiver))
        results = _collect(ranks, timeout)
        finished = True
        return results
    finally:
        # After a failure the other ranks may wait forever in a collective: kill them at once.
        _stop(ranks, grace=EXIT_GRACE_S if finished else 0.0)


def _context():
    """Ranks start as forks of one server process that imported torch and zero_core once (multiprocessing's
    forkserver): a fresh interpreter per rank spent seconds importing them again. The server is started on first
    use, from this process's sys.path; each rank takes this process's environment as of its start (_worker)."""
    context = get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _check_importable(fn) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_distributed needs a module-level function (the child imports it by name); got {qualname!r}"
        )


def _collect(ranks, timeout: float) -> list:
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(ranks):
        pending = [rank for rank in range(len(ranks)) if rank not in results]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {pending} still running after {timeout:g} s; all ranks were killed")
        waitables = [ranks[rank][1] for rank in pending] + [ranks[rank][0].sentinel for rank in pending]
        wait(waitables, timeout=remaining)
        # A rank that died without a result is the cause of what its peers then raise (a collective's "connection
        # reset"), whichever of them is read first: it is reported before any error from the same round.
        errors, died = [], []
        for rank in pending:
            process, receiver = ranks[rank]
            if receiver.poll():
                try:
                    results[rank] = _receive(rank, process, receiver)
                except RankFailed as error:
                    errors.append(error)
                except RuntimeError as error:  # its pipe closed without a message
                    died.append(error)
            elif not process.is_alive():
                died.append(RuntimeError(f"rank {rank} exited with code {process.exitcode} without a result"))
        if died or errors:
            raise (died + errors)[0]
    return [results[rank] for rank in range(len(ranks))]


def _receive(rank: int, process, receiver):
    try:
        status, payload = receiver.recv()
    except EOFError:  # the child died without sending: its pipe closed
        process.join(timeout=EXIT_GRACE_S)
        raise RuntimeError(f"rank {rank} exited with code {process.exitcode} without a result") from None
    if status == "error":
        raise RankFailed(rank, payload)
    return pickle.loads(payload)


def _stop(ranks, grace: float) -> None:
    deadline = time.monotonic() + grace
    for process, receiver in ranks:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
        receiver.close()


def _worker(fn, rank, world_size, port, timeout, sender, args, kwargs, nodes=1, environ=None) -> None:
    if environ is not None:  # the parent's environment now, not the fork server's from when it started
        os.environ.clear()
        os.environ.update(environ)
    if world_size % nodes:
        raise ValueError(f"run_distributed: {world_size} ranks do not split into {nodes} equal nodes")
    per_node = world_size // nodes
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % per_node),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    # A rank still running shortly before the harness kills it prints every thread's stack first (to the test's
    # captured stderr), so a hang says where it hangs.
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)
    try:
        # The group's own timeout outlasts the harness's, so a hang is reported by the harness.
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout + 60))
        result = fn(rank, world_size, *args, **kwargs)
        faulthandler.cancel_dump_traceback_later()
        # Plain pickle copies tensor data; torch's shared-memory pickling would need this process alive.
        message = ("ok", pickle.dumps(result))
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        sender.send(message)
    finally:
        sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()
