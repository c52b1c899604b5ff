"""Heartbeats: how the ranks waiting in a collective tell a stuck rank from a slow one, and say what it does.

Note: why a heartbeat. A rank stuck outside the engine (a deadlock in a data loader, a ``sleep``, an endless
loop in user code) issues no collective, so the guard's comparison of calls finds nothing: the others would
wait until the process group's timeout (30 minutes by default). Every rank's guard thread therefore posts, twice
a second, through the rendezvous store: how many collectives it issued, its last one, how long ago, whether it
is waiting in one itself, and where its main thread is (the innermost frames of its Python stack). A rank
waiting for a collective reads the others' posts once it has waited ``ZERO_CORE_GUARD_STALL_S`` seconds: a rank
that has not reached this collective and is not waiting in any is named, with what it is doing, at once (a
warning), and after ``ZERO_CORE_GUARD_STUCK_S`` seconds (default 300) without a collective it is an error on
every waiting rank, so the job exits instead of waiting for the process group's timeout.

A heartbeat is plain JSON in a fixed schema, like everything the guard exchanges through the store
(wire.py's ``encode_heartbeat``/``decode_heartbeat``): nothing read back is unpickled, and a malformed one is a
``StoreMessageError`` naming its key and rank.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from zero_core.comm.wire import encode_heartbeat

FRAMES = 3  # innermost frames of the stuck rank's stack shown in the message


def main_thread_frames() -> str:
    """Where the main thread is now, innermost last ("file:line in function: source")."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown"
    summary = traceback.extract_stack(frame)[-FRAMES:]
    return " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
                       for f in reversed(summary))


def beat(seq: int, last, since: float, waiting: bool) -> bytes:
    """The heartbeat a guard's thread posts: the state of its rank now."""
    return encode_heartbeat(seq, last, time.monotonic() - since, waiting, main_thread_frames(), os.getpid(),
                            socket.gethostname(), time.time())


def behind(mine_seq: int, theirs: Optional[dict]) -> bool:
    """Whether a rank's heartbeat (decoded: wire.decode_heartbeat) shows it has not reached this rank's
    collective and waits in none."""
    return theirs is not None and theirs["seq"] <= mine_seq and not theirs["waiting"]


def describe(rank: int, theirs: dict, waiting_rank: int, waiting_for: str, silent_s: float = 0.0) -> str:
    """``silent_s``: how long its heartbeat has not changed (a stopped process, or one hung holding the GIL)."""
    last = theirs["last"].describe() if theirs["last"] is not None else "none yet"
    idle = theirs["idle_s"] + silent_s
    where = (f"its main thread is now in {theirs['stack']}" if silent_s < 2 else
             f"its heartbeat stopped {silent_s:.0f} s ago (the process is stopped, or hangs holding the GIL); "
             f"at its last heartbeat its main thread was in {theirs['stack']}")
    return (f"rank {rank} (pid {theirs['pid']} on {theirs['host']}) is stuck or slow: it has issued no collective "
            f"for {idle:.0f} s while rank {waiting_rank} waits for it at {waiting_for}. Its last collective: "
            f"{last}; {where}")


def stuck_message(text: str, stuck_s: float) -> str:
    return (f"{text}. Giving up after ZERO_CORE_GUARD_STUCK_S={stuck_s:g} s without a collective from it (set that "
            "environment variable higher for ranks that legitimately work alone that long, e.g. writing a large "
            "file)")
