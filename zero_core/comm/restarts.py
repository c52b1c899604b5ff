"""A store of its own for each attempt of a job that torchrun (or ``accelerate launch``) restarts.

Note: why an attempt needs its own keys. Under torchelastic the agent hosts one TCPStore for the whole job and
every attempt's ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group``
with ``env://`` uses the plain store, so the ranks of a restarted attempt read what the killed attempt left
there: gloo's addresses of dead processes ("Gloo connectFullMesh failed ... Connection refused"), or the
collective guard's and torch's own counters, which stall the new attempt. Wrapping the agent's store in a
``PrefixStore`` per attempt gives every attempt clean keys; the transport (gloo or NCCL) then never sees the
dead attempt. An attempt is named by ``TORCHELASTIC_RESTART_COUNT`` and the world size: the count grows with
each failure (a lost node included) but not when an elastic job grows because a node joined, and then the world
size differs.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def restart_attempt() -> int:
    """Which attempt of a torchelastic job this process belongs to (0: the first; 0 outside torchelastic)."""
    return int(os.environ.get(RESTART_COUNT, "0"))


def attempt_store(timeout: Optional[timedelta] = None) -> Optional[dist.Store]:
    """The agent's store under this attempt's own key prefix, for ``init_process_group(store=...)``; None when
    the process was not started by a torchelastic agent that hosts the store (then rank 0 hosts a fresh
    store in every attempt and ``env://`` is safe)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or "MASTER_ADDR" not in os.environ:
        return None
    kwargs = {"timeout": timeout} if timeout is not None else {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          use_libuv=True, **kwargs)
    attempt = f"zero_core/attempt_{restart_attempt()}_world_{os.environ.get('WORLD_SIZE', '')}"
    return dist.PrefixStore(attempt, store)


def init_process_group_for_attempt(backend: str, timeout: Optional[timedelta] = None, **kwargs) -> None:
    """``dist.init_process_group`` over :func:`attempt_store` when under a torchelastic agent, else with env://.
    Rank and world size come from ``RANK`` / ``WORLD_SIZE`` unless given."""
    store = attempt_store(timeout)
    if store is not None:
        kwargs.setdefault("rank", int(os.environ["RANK"]))
        kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
        kwargs["store"] = store
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, **kwargs)


def accumulation_for(global_batch: int, micro_batch: int, world_size: Optional[int] = None) -> int:
    """The gradient accumulation that keeps ``global_batch`` samples per optimizer step on ``world_size`` ranks
    (default: the process group's) of ``micro_batch`` samples each: what an elastic job that restarted at
    another size uses. Raises a one-line ValueError when the sizes do not divide."""
    world = world_size if world_size is not None else dist.get_world_size()
    if global_batch % (micro_batch * world):
        raise ValueError(f"a global batch of {global_batch} samples cannot be kept on {world} ranks with micro-batches "
                         f"of {micro_batch}: {global_batch} is not a multiple of {micro_batch} x {world}; run on a "
                         f"number of ranks that divides {global_batch // micro_batch}, or change the micro-batch")
    return global_batch // (micro_batch * world)
