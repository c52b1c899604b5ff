"""Small collectives for checkpointing, on the engine's counted communicator.

Every rank must reach the same decision (go on, or raise the same error), or one rank would wait forever in
the next collective while another has given up. So each step that can fail on one rank ends in :func:`agree`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from zero_core.checkpoint.files import StagedDirectory
from zero_core.checkpoint.format import CheckpointError, CheckpointMismatchError

_ERRORS = {cls.__name__: cls for cls in (CheckpointError, CheckpointMismatchError, FileNotFoundError)}


def gather_json(engine, obj: Any) -> list:
    """Every rank's JSON-serialisable ``obj``, in rank order, on every rank."""
    world, device = engine.topology.world_size, engine.device
    data = json.dumps(obj).encode()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    engine.comm.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    longest = int(sizes.max())
    local = torch.zeros(longest, dtype=torch.uint8)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = torch.empty(world * longest, dtype=torch.uint8, device=device)
    engine.comm.all_gather(gathered, local.to(device))
    rows = gathered.cpu().view(world, longest)
    return [json.loads(bytes(rows[r, : int(sizes[r])].numpy())) for r in range(world)]


def shared_token(engine) -> str:
    """A random name part chosen by rank 0 and known to every rank (for the temporary directory)."""
    value = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=engine.device)
    engine.comm.broadcast(value, src=0)
    return f"{int(value):016x}"


def describe_error(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error)}


def agree(engine, error: Optional[BaseException]) -> None:
    """Raise on every rank if any rank failed: a rank re-raises its own error, the others the first one."""
    reports = gather_json(engine, describe_error(error) if error is not None else None)
    if error is not None:
        raise error
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if failed:
        rank, report = failed[0]
        cls = _ERRORS.get(report["type"], CheckpointError)
        raise cls(f"{report['message']} (reported by rank {rank})")


def run_agreed(engine, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on every rank, then :func:`agree` on whether it raised; returns its result."""
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as caught:  # reported to every rank by agree, then re-raised here
        error = caught
    agree(engine, error)
    return result


def on_first_replica(engine, write, *args) -> None:
    """MiCS: every replica holds the same shards, so the first one writes them alone (its collectives stay
    inside its shard group); every rank returns once the files are complete."""
    if engine.topology.replicas == 1:
        write(*args)
        return
    if engine.topology.replica_index == 0:
        with engine.comm.shard_group_only():
            write(*args)
    engine.comm.barrier_world()


@contextlib.contextmanager
def staged_together(engine, staged: StagedDirectory, leader: bool) -> Iterator[Path]:
    """A :class:`StagedDirectory` that every rank writes into: the leader prepares it (agreed by all) and
    removes it when anything fails; the leader publishes it, inside the block, once every rank has written."""
    run_agreed(engine, _prepare_staged, staged, leader)
    try:
        yield staged.temp
    except BaseException:
        if leader:
            staged.discard()
        raise


def _prepare_staged(staged: StagedDirectory, leader: bool) -> None:
    if leader:
        staged.prepare()
