"""The always-on collective-order guard: a divergence between ranks becomes an error, never a hang or an abort.

Every collective the Communicator issues is recorded here first (kind, element count, dtype, module, step) into
a running fingerprint and a short history: a few tuple operations, no communication. Two cheap mechanisms turn
a divergence into an error on every rank that names the ranks, the module, the step and the two calls:

- **A step barrier through the rendezvous store** (not through the process group): at the start of every
  optimizer step each rank posts its collective count and fingerprint and reads the others'. Ranks that issued
  different collectives in the step stop here, before the step applies anything. Because a rank waiting here is
  parked in the store and not inside the transport, a rank still issuing collectives (an extra forward or
  backward) cannot pair them with a mismatched collective of this rank: gloo aborts the process when sizes
  differ, so that must never reach it.
- **A stall watchdog**: every wait on a collective polls; once a collective (or the barrier) has waited
  ``ZERO_CORE_GUARD_STALL_S`` seconds (default 5), this rank posts where it is to the store and reads where the
  others are. It raises only when another rank is provably somewhere else (another collective at the same
  position, or the step barrier); a slow but consistent collective (a long save, a first NCCL call) keeps
  waiting. The first rank to find a mismatch posts it, and every other rank raises the same error when it next
  waits.

Everything posted to the store is plain JSON in a fixed schema, read back without executing anything (wire.py).
``ZERO_CORE_CHECK_COLLECTIVES=1`` (the ``Communicator``'s ``check``) remains the debug mode that compares every call before issuing it;
``ZERO_CORE_COLLECTIVE_GUARD=0`` turns this guard off. docs/reliability.md explains what is promised.
"""

from __future__ import annotations

import atexit
import itertools
import warnings
import os
import sys
import threading
import time
import weakref
import zlib
from collections import defaultdict, deque
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from zero_core.comm import heartbeat
from zero_core.comm.errors import CollectiveMismatchError, StoreMessageError
from zero_core.comm.topology import Topology
from zero_core.comm.wire import (
    Call,
    decode_failure,
    decode_heartbeat,
    decode_history,
    decode_whereabouts,
    encode_failure,
    encode_whereabouts,
)

# Engines over one group are built in the same order on its ranks: the n-th one over a group shares a namespace.
_GUARD_IDS: dict[tuple, "itertools.count[int]"] = defaultdict(itertools.count)
_WAIT_TIMED_OUT = "Operation timed out"  # what Work.wait(timeout) raises; the work stays valid
_WAIT_IGNORES_TIMEOUT = {"reduce_scatter"}  # gloo's reduce-scatter handle blocks in wait(timeout) regardless


__all__ = ["Call", "CollectiveGuard", "CollectiveMismatchError", "StoreMessageError"]


class CollectiveGuard:
    """Records this rank's collectives; checks them against the other ranks' at each step and on a stall."""

    HISTORY = 16
    READERS_WAIT_S = 2.0  # at most this long, a rank that posts a failure waits for the others to read it

    def __init__(self, topology: Topology) -> None:
        self.rank = topology.rank
        self.world_size = topology.world_size
        self.enabled = topology.world_size > 1 and os.environ.get("ZERO_CORE_COLLECTIVE_GUARD", "1") != "0"
        self.stall_s = float(os.environ.get("ZERO_CORE_GUARD_STALL_S", "5"))
        self.poll = timedelta(seconds=min(1.0, self.stall_s))
        self.stall = timedelta(seconds=self.stall_s)
        # A rank that issues no collective this long while others wait for it is an error (heartbeat.py).
        self.stuck_s = float(os.environ.get("ZERO_CORE_GUARD_STUCK_S", "300"))
        self.last_collective_at = time.monotonic()
        self.waiting = False
        self._named: set = set()  # (rank, seq) already warned about
        self._beats: dict = {}  # rank -> (its latest heartbeat's bytes, when this rank first saw them, decoded)
        # NCCL: wait() makes the current stream wait for the collective, but wait(timeout) blocks the host until
        # it is done, which would stall every overlapped gather and reduction; there waits are plain and a
        # stall is left to NCCL's own watchdog (TORCH_NCCL timeouts). The step barrier still compares ranks.
        self.stream_ordered = self.enabled and dist.get_backend(topology.group) == "nccl"
        self.seq = 0
        self.step = 0
        self.fingerprint = 0
        self.history: deque = deque(maxlen=self.HISTORY)
        self.blocked: Optional[tuple[Call, float]] = None  # a wait that cannot time out, and since when
        self.stale_keys: deque = deque()  # store keys the watchdog thread deletes
        self._cleanup_store: Optional[dist.Store] = None
        self._codes: dict = {}
        self._failure: Optional[tuple[type, str]] = None  # (error class, message) every rank raises
        self._store: Optional[dist.Store] = None
        members = tuple(dist.get_global_rank(topology.group or dist.group.WORLD, r) for r in range(self.world_size))
        group = "-".join(map(str, members)) if len(members) <= 8 else f"{zlib.crc32(repr(members).encode()):x}"
        self._namespace = f"zero_core/guard/{group}/{next(_GUARD_IDS[members])}/"
        self._step_hooks: list[tuple[Callable[[], object], Callable[[list], None]]] = []
        if self.enabled:  # heartbeats let the others name this rank if it gets stuck; the first one now
            self._get_store().set(f"alive/{self.rank}", heartbeat.beat(0, None, self.last_collective_at, False))
            _Watchdog.watch(self)

    # -- recording (every collective) ----------------------------------------------------------------------
    def record(self, kind: str, numel: int, dtype, label: str) -> Optional[Call]:
        """Note a collective about to be issued; raises if another rank already found a mismatch."""
        if not self.enabled:
            return None
        if self._failure is not None:
            self._raise_failure()
        key = (kind, dtype, label)
        known = self._codes.get(key)
        if known is None:  # str hashes differ between processes; crc32 does not
            name = str(dtype).replace("torch.", "")
            known = self._codes[key] = (name, zlib.crc32(f"{kind}/{name}/{label}".encode()))
        call = Call(self.seq, kind, numel, known[0], label, self.step)
        self.fingerprint = hash((self.fingerprint, known[1], numel))
        self.history.append(call)
        self.seq += 1
        self.last_collective_at = time.monotonic()
        return call

    def wait(self, work: Optional[dist.Work], call: Optional[Call]) -> None:
        """Wait for ``work``; a stall of ``stall_s`` seconds is checked against the other ranks."""
        if work is None:
            return
        if call is None or self.stream_ordered:
            work.wait()
            return
        self.waiting = True
        try:
            if call[1] in _WAIT_IGNORES_TIMEOUT:
                self._wait_blocking(work, call)
            elif not self._poll(work, call):
                self._wait_stalled(work, call)
        finally:
            self.waiting = False

    def _poll(self, work: dist.Work, call: Call) -> bool:
        """Wait one poll interval: True once the collective completed, False while it still runs."""
        try:
            work.wait(self.poll)
            return True
        except RuntimeError as error:
            if _WAIT_TIMED_OUT not in str(error):
                self._fail_after_transport_error(call, error)
                raise
            return False

    def _wait_stalled(self, work: dist.Work, call: Call) -> None:
        """The collective did not complete within one poll: keep polling, check the others once it stalls."""
        started = time.monotonic() - self.poll.total_seconds()
        while True:
            self._raise_posted_failure()
            if time.monotonic() - started >= self.stall_s:
                self._diagnose({"where": "collective", "seq": call.seq, "call": call, "step": self.step})
                started = time.monotonic()
            if self._poll(work, call):
                return

    def _wait_blocking(self, work: dist.Work, call: Call) -> None:
        """gloo's reduce-scatter handle ignores wait()'s timeout: block, and let the watchdog thread post where
        this rank is once it stalls, so the others can name the mismatch. When the rank that finds it exits, this
        wait fails ('connection closed') and raises the mismatch it posted."""
        self.blocked = (call, time.monotonic())
        _Watchdog.watch(self)
        try:
            work.wait()
        except RuntimeError as error:
            self._fail_after_transport_error(call, error)
            raise
        finally:
            self.blocked = None

    def delete_stale_keys(self) -> None:
        """From the watchdog thread, on its own connection: drop barrier keys every rank has read."""
        if not self.stale_keys:
            return
        if self._cleanup_store is None:
            self._cleanup_store = dist.PrefixStore(self._namespace, dist.distributed_c10d._get_default_store().clone())
        while self.stale_keys:
            self._cleanup_store.delete_key(self.stale_keys.popleft())

    def post_heartbeat(self) -> None:
        """From the watchdog thread, on its own connection: this rank's heartbeat (heartbeat.py)."""
        if self._cleanup_store is None:
            self._cleanup_store = dist.PrefixStore(self._namespace, dist.distributed_c10d._get_default_store().clone())
        last = self.history[-1] if self.history else None
        self._cleanup_store.set(f"alive/{self.rank}", heartbeat.beat(self.seq, last, self.last_collective_at,
                                                                     self.waiting))

    def post_if_stalled(self) -> None:
        """From the watchdog thread: post the blocked call's status once it has waited ``stall_s``."""
        blocked = self.blocked
        if blocked is not None and time.monotonic() - blocked[1] >= self.stall_s:
            call = blocked[0]
            status = {"where": "collective", "seq": call.seq, "call": call, "step": call.step,
                      "history": tuple(self.history)}
            store = self._get_store()
            store.set(f"status/{self.rank}", encode_whereabouts(status))
            # Keep the mismatch another rank posts: when that rank exits it may take the store with it (rank 0
            # hosts it), and this rank's blocked wait then fails with only the transport's error.
            if self._failure is None and store.check(["failure"]):
                self._failure = self._read_failure(store)
            self._exit_if_peer_stuck(call)

    def _exit_if_peer_stuck(self, call: Call) -> None:
        """From the watchdog thread, while the main thread is blocked in a wait that cannot time out: a stuck
        peer (or a malformed heartbeat, which leaves the ranks unable to tell) is an error that only ending the
        process can deliver (the wait itself would last the group's timeout). It is posted as the job's failure
        first, so the other ranks raise it too."""
        error = CollectiveMismatchError
        try:
            problem = self._stuck_peer(call.seq, f"collective #{call.seq} ({call.kind})", self._cleanup_store)
        except StoreMessageError as malformed:
            problem, error = str(malformed), StoreMessageError
        if problem is not None:
            try:
                if not self._cleanup_store.check(["failure"]):
                    self._cleanup_store.set("failure", encode_failure(self.rank, error, problem))
            finally:
                sys.stderr.write(f"zero_core: {problem}\n")
                sys.stderr.flush()
                os._exit(1)

    # -- the step barrier ----------------------------------------------------------------------------------
    def on_step(self, provide: Callable[[], object], consume: Callable[[list], None]) -> None:
        """Exchange a small note at every step barrier: ``consume`` gets every rank's ``provide()``."""
        self._step_hooks.append((provide, consume))

    def step_barrier(self) -> None:
        """Call at the start of an optimizer step, before its collectives: every rank must have issued the
        same collectives since the last one. Raises a CollectiveMismatchError naming the first difference."""
        notes = [provide() for provide, _ in self._step_hooks]
        if not self.enabled:
            for (_, consume), note in zip(self._step_hooks, notes):
                consume([note])
            self.step += 1
            return
        if self._failure is not None:  # a failure posted by another rank shows once the wait below stalls
            self._raise_failure()
        mine = {"where": "barrier", "seq": self.seq, "fingerprint": self.fingerprint, "step": self.step,
                "history": tuple(self.history), "notes": notes}
        store = self._get_store()
        keys = [f"step/{self.step}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], encode_whereabouts(mine))
        self.waiting = True
        try:
            self._wait_keys(keys, mine)
        finally:
            self.waiting = False
        everyone = [self._decode(value, keys[r], r, len(notes), history=False)
                    for r, value in enumerate(store.multi_get(keys))]
        if self.step >= 2:  # every rank has read step - 2's keys before posting step - 1's; off the step's path
            self.stale_keys.append(f"step/{self.step - 2}/{self.rank}")
            _Watchdog.watch(self)
        for rank, theirs in enumerate(everyone):
            if (theirs["seq"], theirs["fingerprint"]) != (mine["seq"], mine["fingerprint"]):
                key = self._namespace + keys[rank]
                theirs["history"] = self._decoded(lambda: decode_history(theirs["history"], key, rank))
                self._fail(self._describe_step_mismatch(mine, theirs, rank))
        for index, (_, consume) in enumerate(self._step_hooks):
            consume([theirs["notes"][index] for theirs in everyone])
        self.step += 1

    def _wait_keys(self, keys: list[str], mine: dict) -> None:
        """Wait for every rank's key; like a collective, give up after the process group's timeout."""
        store, timeout, started = self._get_store(), self.stall, time.monotonic()
        limit = dist.distributed_c10d._get_default_store().timeout.total_seconds()
        while True:
            try:
                store.wait(keys, timeout)  # a timed-out wait logs a line: poll often only once stalled
                return
            except (RuntimeError, dist.DistStoreError) as error:
                if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
                    raise
            self._raise_posted_failure()
            self._diagnose(mine)
            timeout = self.poll
            if time.monotonic() - started > limit:
                missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
                raise RuntimeError(
                    f"rank {self.rank} waited {limit:.0f} s (the process group's timeout) at the optimizer step of "
                    f"step {self.step} for ranks {missing}, which issued no collective meanwhile: they died, hang "
                    "outside the engine, or stopped training early (engine.join() for uneven inputs)")

    # -- diagnosis through the store -----------------------------------------------------------------------
    def _get_store(self) -> dist.Store:
        if self._store is None:
            # The rendezvous store: it does not depend on the process group's transport, which may be stuck.
            self._store = dist.PrefixStore(self._namespace, dist.distributed_c10d._get_default_store())
        return self._store

    def _diagnose(self, mine: dict) -> None:
        """Post where this rank waits; raise if another rank provably waits somewhere else."""
        store = self._get_store()
        status = {**mine, "history": tuple(self.history)}
        store.set(f"status/{self.rank}", encode_whereabouts(status))
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            theirs = self._status_of(rank, status["step"])
            if theirs is not None:
                problem = self._conflict(status, theirs, rank)
                if problem:
                    self._fail(problem)
        where = f"collective #{mine['seq']} ({mine['call'].kind})" if mine["where"] == "collective" else \
            f"the optimizer step of step {mine['step']}"
        problem = self._decoded(lambda: self._stuck_peer(mine["seq"], where, store))
        if problem is not None:
            self._fail(problem)

    def _stuck_peer(self, seq: int, where: str, store: dist.Store) -> Optional[str]:
        """Name (a warning) every rank whose heartbeat shows it behind this rank and in no collective; return the
        error for one that has been so for ``stuck_s`` seconds. A malformed heartbeat raises StoreMessageError
        naming its key and rank (wire.py): nothing read is unpickled."""
        for rank in range(self.world_size):
            key = f"alive/{rank}"
            if rank == self.rank or not store.check([key]):
                continue
            raw = store.get(key)
            seen = self._beats.get(rank)
            if seen is None or seen[0] != raw:  # decoded once per new heartbeat
                seen = self._beats[rank] = (raw, time.monotonic(), decode_heartbeat(raw, self._namespace + key, rank))
            theirs, silent_s = seen[2], time.monotonic() - seen[1]
            if not heartbeat.behind(seq, theirs):
                continue
            text = heartbeat.describe(rank, theirs, self.rank, where, silent_s)
            if theirs["idle_s"] + silent_s >= self.stuck_s:
                return heartbeat.stuck_message(text, self.stuck_s)
            if (rank, theirs["seq"]) not in self._named:
                self._named.add((rank, theirs["seq"]))
                warnings.warn(f"zero_core: {text} (an error after ZERO_CORE_GUARD_STUCK_S={self.stuck_s:g} s)",
                              RuntimeWarning, stacklevel=2)
        return None

    def _status_of(self, rank: int, step: int) -> Optional[dict]:
        """The other rank's latest posted whereabouts: at this step's barrier, or stalled in a collective."""
        store = self._get_store()
        for key, notes in ((f"step/{step}/{rank}", len(self._step_hooks)), (f"status/{rank}", None)):
            if store.check([key]):
                return self._decode(store.get(key), key, rank, notes)
        return None

    def _decode(self, raw: bytes, key: str, rank: int, notes: Optional[int], history: bool = True) -> dict:
        """A rank's posted whereabouts (wire.py)."""
        return self._decoded(lambda: decode_whereabouts(raw, self._namespace + key, rank, notes, history))

    def _decoded(self, decode: Callable[[], object]):
        """``decode()`` (or anything that decodes a value read from the store); a malformed value stops every
        rank (they cannot be compared)."""
        try:
            return decode()
        except StoreMessageError as error:
            self._fail(str(error), StoreMessageError)

    def _conflict(self, mine: dict, theirs: dict, rank: int) -> Optional[str]:
        """A description of the divergence, or None while ``theirs`` may still be on its way to where we are."""
        if theirs["seq"] != mine["seq"] or (theirs["where"] == "barrier" and theirs["step"] != mine["step"]):
            return None  # stale (an earlier stall or step) or passing through: no proof yet
        if mine["where"] == "barrier" and theirs["where"] == "barrier":
            return None  # both at the barrier: it completes
        if mine["where"] == "collective" and theirs["where"] == "collective":
            if _same_call(mine["call"], theirs["call"]):
                return None  # both inside the same collective: slow, not divergent
            return self._two_calls(mine["call"], rank, theirs["call"])
        here, there = (mine, theirs) if mine["where"] == "collective" else (theirs, mine)
        caller, waiter = (self.rank, rank) if here is mine else (rank, self.rank)
        return (f"collective mismatch: rank {caller} calls {here['call'].describe()}, but rank {waiter} has issued "
                f"all {there['seq']} collectives before it and waits at the optimizer step of step {there['step']}. "
                f"{_ADVICE}")

    def _two_calls(self, call: Call, rank: int, theirs: Call) -> str:
        return (f"collective mismatch: rank {self.rank} calls {call.describe()}, but rank {rank} calls "
                f"{theirs.describe()}. {_ADVICE}")

    def _describe_step_mismatch(self, mine: dict, theirs: dict, rank: int) -> str:
        by_seq = {c.seq: c for c in theirs["history"]}
        for call in mine["history"]:
            other = by_seq.get(call.seq)
            if other is not None and not _same_call(call, other):
                return self._two_calls(call, rank, other)
        if mine["seq"] != theirs["seq"]:
            more, fewer = (mine, theirs) if mine["seq"] > theirs["seq"] else (theirs, mine)
            more_rank, fewer_rank = (self.rank, rank) if more is mine else (rank, self.rank)
            extra = next((c for c in more["history"] if c.seq == fewer["seq"]), None)
            first = f"; its first extra one is {extra.describe()}" if extra else ""
            return (f"collective mismatch: at the optimizer step of step {mine['step']} rank {more_rank} has issued "
                    f"{more['seq']} collectives but rank {fewer_rank} {fewer['seq']}{first}. {_ADVICE}")
        return (f"collective mismatch: before the optimizer step of step {mine['step']} ranks {self.rank} and {rank} "
                f"issued the same number of collectives ({mine['seq']}) but different ones (an earlier call than the "
                f"last {self.HISTORY} differs; ZERO_CORE_CHECK_COLLECTIVES=1 names it). {_ADVICE}")

    def fail(self, message: str, error: type = CollectiveMismatchError) -> None:
        """Raise ``error(message)`` here, and on every other rank when it next waits for a collective or at
        the next step barrier (an error on one rank alone would leave the others waiting for it)."""
        if not self.enabled:
            raise error(message)
        try:
            self._fail(message)
        except CollectiveMismatchError:
            raise error(message) from None

    def _fail(self, message: str, error: type = CollectiveMismatchError) -> None:
        """Tell every rank (through the store) and raise here."""
        if self._failure is None:
            self._failure = (error, message)
            try:
                store = self._get_store()
                if not store.check(["failure"]):
                    store.set("failure", encode_failure(self.rank, error, message))
                    self._await_readers(store)
            except Exception:  # noqa: BLE001 - the error below matters more than telling the others
                pass
        self._raise_failure()

    def _await_readers(self, store: dist.Store) -> None:
        """Give the other ranks a moment to read the posted failure before this rank raises it: a rank blocked
        in a wait that cannot time out reads it from its watchdog thread (every half second), and when this rank
        exits it may take the store with it (rank 0 hosts it without a launcher's agent), leaving that rank only
        the transport's 'connection closed'. At most READERS_WAIT_S, once per job."""
        others = [f"failure_seen/{rank}" for rank in range(self.world_size) if rank != self.rank]
        deadline = time.monotonic() + self.READERS_WAIT_S
        while others and time.monotonic() < deadline and not store.check(others):
            time.sleep(0.05)

    def _raise_failure(self) -> None:
        error, message = self._failure
        raise error(message)

    def _read_failure(self, store: dist.Store) -> tuple[type, str]:
        """The posted failure; a malformed one becomes a StoreMessageError naming the key, for the caller to raise.
        Says it was read (the rank that posted it waits for that before it raises and maybe exits)."""
        try:
            found = decode_failure(store.get("failure"), self._namespace + "failure")
        except StoreMessageError as error:
            found = StoreMessageError, str(error)
        store.set(f"failure_seen/{self.rank}", b"1")
        return found

    def _raise_posted_failure(self) -> None:
        if self._failure is None:
            store = self._get_store()
            if not store.check(["failure"]):
                return
            self._failure = self._read_failure(store)
        self._raise_failure()

    def _fail_after_transport_error(self, call: Call, error: RuntimeError) -> None:
        """The transport failed (a peer exited, or the group's timeout): report a posted mismatch if any."""
        try:
            self._raise_posted_failure()
        except CollectiveMismatchError as mismatch:
            raise mismatch from error
        except Exception:  # noqa: BLE001 - the store may be gone too; the transport's error is raised
            pass


class _Watchdog:
    """One daemon thread per process: posts the status of guards blocked in a wait that cannot time out, and
    deletes the step barrier's old keys (so the store does not grow with the steps)."""

    _guards: "weakref.WeakSet[CollectiveGuard]" = weakref.WeakSet()
    _thread: Optional[threading.Thread] = None
    _lock = threading.Lock()
    _stopping = threading.Event()

    @classmethod
    def watch(cls, guard: CollectiveGuard) -> None:
        if guard in cls._guards and cls._thread is not None:
            return
        with cls._lock:
            cls._guards.add(guard)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="zero_core-collective-guard", daemon=True)
                cls._thread.start()
                atexit.register(cls.stop)

    @classmethod
    def stop(cls) -> None:
        """At interpreter exit, before finalisation: a daemon thread still inside a store call while the process
        finalises aborts it ("terminate called without an active exception", seen with torchrun scripts that
        return normally), so the thread ends here first."""
        cls._stopping.set()
        thread = cls._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    @classmethod
    def _run(cls) -> None:
        while not cls._stopping.wait(0.5):
            cls._tend()

    @classmethod
    def _tend(cls) -> None:
        """One round over the guards, in its own frame: a loop variable left in ``_run``'s frame would hold the
        last guard strongly while the thread sleeps, and through its step hooks the runtime and the model of a
        dropped engine (a thread's frame is a root the cycle collector cannot free: a leak for good, since the
        guard then never leaves the weak set)."""
        for guard in list(cls._guards):
            try:
                guard.post_heartbeat()
                guard.post_if_stalled()
                guard.delete_stale_keys()
            except Exception:  # noqa: BLE001 - the store may be gone at exit; the main thread reports errors
                pass


def _same_call(a: Call, b: Call) -> bool:
    return (a.kind, a.numel, a.dtype, a.label) == (b.kind, b.numel, b.dtype, b.label)


_ADVICE = ("Every rank must issue the same collectives in the same order: run the same number of forward and "
           "backward passes per step and the same number of steps (engine.join() for uneven inputs); see "
           "docs/reliability.md.")
