"""What the collective guard writes to the rendezvous store, and how it reads it back: plain JSON, size-limited and
checked against a fixed schema. Nothing read from the store is ever executed.

The store (torch's TCPStore on ``MASTER_ADDR:MASTER_PORT``) has no authentication: in a multi-node job anyone on
the network can write a key. So a value read back is only data: ``json.loads`` (which builds dicts, lists,
strings and numbers, nothing else) of at most ``MAX_BYTES``, then every field is checked for its type, and the
collective records become ``Call`` tuples again. Anything else raises ``StoreMessageError`` naming the key and
the rank the key belongs to. docs/reliability.md, "What crosses the store", lists the messages.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple, Optional

from zero_core.comm.errors import CollectiveMismatchError, StoreMessageError

MAX_BYTES = 64 * 1024  # a step note of 16 calls is about 1 kB
MAX_MESSAGE = 16 * 1024  # a posted failure's text
MAX_HISTORY = 64  # the guard keeps 16 calls
MAX_HEARTBEAT = 4 * 1024  # a heartbeat is about 600 bytes; its frames are cut to fit
MAX_HOST = 255  # a host name's longest
_LONG_LABEL = 256  # module names are cut to this only where a message would exceed MAX_BYTES
_INT64 = 1 << 63
_SCALARS = (bool, int, float, str, type(None))  # what a step hook's note may be


class Call(NamedTuple):
    """One collective as this rank issued it (a plain tuple underneath: built on every collective)."""

    seq: int  # how many collectives this guard issued before it
    kind: str
    numel: int
    dtype: str
    label: str  # the module it serves, or '' for engine-wide ones
    step: int  # optimizer steps completed before it

    def describe(self) -> str:
        where = f" for '{self.label}'" if self.label else ""
        return f"{self.kind} of {self.numel} {self.dtype} elements{where} (collective #{self.seq}, step {self.step})"


_CALL_FIELDS = (int, str, int, str, str, int)
# The two shapes of a rank's whereabouts: at the step barrier (its step note), or stalled in a collective.
_SCHEMAS = {
    "barrier": {"where": str, "seq": int, "fingerprint": int, "step": int, "history": list, "notes": list},
    "collective": {"where": str, "seq": int, "call": list, "step": int, "history": list},
}
# A posted failure names the error class to raise; only these two can be named.
_ERRORS = {cls.__name__: cls for cls in (CollectiveMismatchError, StoreMessageError)}


class _Malformed(ValueError):
    pass


def encode_whereabouts(message: dict) -> bytes:
    """A step note or stall status as compact JSON (``Call`` tuples become lists)."""
    for note in message.get("notes", ()):
        if type(note) not in _SCALARS:  # a programming error in a step hook, not something read
            raise TypeError(f"a step hook's note must be a bool, number, string or None, got {type(note).__name__}")
    raw = json.dumps(message, separators=(",", ":")).encode()
    if len(raw) > MAX_BYTES:  # only with very long module names: cut them, identically on every rank
        short = {**message, "history": [c._replace(label=c.label[:_LONG_LABEL]) for c in message["history"]]}
        if "call" in message:
            short["call"] = message["call"]._replace(label=message["call"].label[:_LONG_LABEL])
        raw = json.dumps(short, separators=(",", ":")).encode()
    return raw


def decode_whereabouts(raw: bytes, key: str, rank: int, notes: Optional[int] = None, history: bool = True) -> dict:
    """The message a rank posted under ``key``; StoreMessageError if it is anything else. ``notes``: a step note
    (the step barrier's key) is expected, with that many step-hook notes. ``history=False`` leaves the history
    as JSON lists, for :func:`decode_history` once it is needed: the step barrier reads every rank's note at
    every step but another rank's history only to describe a mismatch (its check is most of the cost)."""
    try:
        message = _parse(raw)
        if type(message) is not dict:
            raise _Malformed("not a JSON object")
        schema = _SCHEMAS.get(message["where"]) if type(message.get("where")) is str else None
        if schema is None or message.keys() != schema.keys():
            raise _Malformed(f"unexpected fields {sorted(map(str, message))[:8]}")
        for field, kind in schema.items():
            _check(message[field], kind, field)
        if notes is not None and (message["where"] != "barrier" or len(message["notes"]) != notes):
            raise _Malformed(f"not a step note with {notes} step-hook notes")
        if len(message["history"]) > MAX_HISTORY:
            raise _Malformed(f"more than {MAX_HISTORY} entries in 'history'")
        if history:
            message["history"] = [_call(c, "history") for c in message["history"]]
        if "call" in message:
            message["call"] = _call(message["call"], "call")
        if not all(type(note) in _SCALARS for note in message.get("notes", ())):
            raise _Malformed("a note is not a bool, number, string or null")
        if not 0 <= message["seq"] < _INT64 or not 0 <= message["step"] < _INT64:
            raise _Malformed("seq or step out of range")
    except _Malformed as problem:
        raise _error(key, rank, raw, problem) from None
    return message


def decode_history(history: list, key: str, rank: int) -> list[Call]:
    """The collective records of a note decoded with ``history=False``."""
    try:
        return [_call(c, "history") for c in history]
    except _Malformed as problem:
        raise _error(key, rank, json.dumps(history).encode(), problem) from None


def encode_failure(rank: int, error: type, message: str) -> bytes:
    """The failure a rank posts for every other rank to raise."""
    return json.dumps({"rank": rank, "error": error.__name__, "message": message[:MAX_MESSAGE]}).encode()


def decode_failure(raw: bytes, key: str) -> tuple[type, str]:
    """(error class, message) of a posted failure; StoreMessageError if it is anything else. Any rank may post
    it (the first to find a mismatch), so a malformed one names the key only."""
    try:
        failure = _parse(raw)
        if type(failure) is not dict or failure.keys() != {"rank", "error", "message"}:
            raise _Malformed("not a JSON object with the fields rank, error and message")
        _check(failure["rank"], int, "rank")
        _check(failure["message"], str, "message")
        error = _ERRORS.get(failure["error"])
        if error is None:
            raise _Malformed(f"unknown error {str(failure['error'])[:40]!r}")
    except _Malformed as problem:
        raise _error(key, None, raw, problem) from None
    return error, failure["message"]


_HEARTBEAT = {"seq": int, "last": list, "idle_s": float, "waiting": bool, "stack": str, "pid": int, "host": str,
              "sent": float}


def encode_heartbeat(seq: int, last: Optional[Call], idle_s: float, waiting: bool, stack: str, pid: int,
                     host: str, sent: float) -> bytes:
    """A rank's heartbeat (heartbeat.py) as compact JSON of at most ``MAX_HEARTBEAT`` bytes: a long module name
    and host are cut, then the frames (innermost first) are cut from their outer end to fit."""
    if last is not None and len(last.label) > _LONG_LABEL:
        last = last._replace(label=last.label[:_LONG_LABEL])
    message = {"seq": seq, "last": last, "idle_s": float(idle_s), "waiting": bool(waiting), "stack": stack,
               "pid": pid, "host": host[:MAX_HOST], "sent": float(sent)}
    raw = json.dumps(message, separators=(",", ":")).encode()
    if len(raw) > MAX_HEARTBEAT:  # the rest fits with room to spare: at most ~3.3 kB even if all escaped
        stack, message["stack"] = stack, ""
        room = MAX_HEARTBEAT - len(json.dumps(message, separators=(",", ":")).encode()) - len("...")
        while len(json.dumps(stack)) - 2 > room:  # escaped length; cut in proportion, at least one character
            stack = stack[:min(len(stack) - 1, len(stack) * room // (len(json.dumps(stack)) - 2))]
        message["stack"] = stack + "..."
        raw = json.dumps(message, separators=(",", ":")).encode()
    return raw


def decode_heartbeat(raw: bytes, key: str, rank: int) -> dict:
    """The heartbeat a rank posted under ``key``, with ``last`` a ``Call`` (or None before its first collective);
    StoreMessageError naming the key and the rank if it is anything else."""
    try:
        beat = _parse(raw, MAX_HEARTBEAT)
        if type(beat) is not dict or beat.keys() != _HEARTBEAT.keys():
            raise _Malformed("not a JSON object with exactly the fields " + ", ".join(_HEARTBEAT))
        for field, kind in _HEARTBEAT.items():
            if field == "last" and beat[field] is None:
                continue
            _check(beat[field], kind, field, MAX_HEARTBEAT)
        if not 0 <= beat["seq"] < _INT64 or not 0 <= beat["pid"] < _INT64:
            raise _Malformed("seq or pid out of range")
        if not (math.isfinite(beat["idle_s"]) and math.isfinite(beat["sent"])):
            raise _Malformed("idle_s or sent is not a finite number")
        if len(beat["host"]) > MAX_HOST:
            raise _Malformed(f"field 'host' is longer than {MAX_HOST} characters")
        if beat["last"] is not None:
            beat["last"] = _call(beat["last"], "last")
    except _Malformed as problem:
        raise _error(key, rank, raw, problem) from None
    return beat


def _parse(raw: bytes, limit: int = MAX_BYTES):
    if len(raw) > limit:
        raise _Malformed(f"{len(raw)} bytes, more than the {limit} allowed")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _Malformed(f"not UTF-8 JSON ({type(error).__name__})") from None


def _check(value, kind: type, field: str, longest: int = MAX_MESSAGE) -> None:
    if type(value) is not kind:  # `type is`: a JSON true is not an int here
        raise _Malformed(f"field {field!r} is not a {kind.__name__}")
    if kind is int and not -_INT64 <= value < _INT64:
        raise _Malformed(f"field {field!r} is out of range")
    if kind is str and len(value) > longest:
        raise _Malformed(f"field {field!r} is longer than {longest} characters")


def _call(value, field: str) -> Call:
    # One comparison of the item types (this runs for 16 records per rank at every step): the whole message's
    # size limit already bounds each string's length and each number's digits.
    if type(value) is not list or tuple(map(type, value)) != _CALL_FIELDS:
        raise _Malformed(f"an entry of {field!r} is not a collective record")
    return Call._make(value)


def _error(key: str, rank: Optional[int], raw: bytes, problem: _Malformed) -> StoreMessageError:
    owner = f"rank {rank}'s key" if rank is not None else "the key"
    return StoreMessageError(
        f"the collective guard read a malformed value from the rendezvous store: {owner} {key!r} holds "
        f"{len(raw)} bytes beginning {bytes(raw[:24])!r}, which is not what a rank of this job writes there "
        f"({problem}). Nothing of it was run; the job stops because the ranks cannot be compared. The store "
        "(MASTER_ADDR:MASTER_PORT) has no authentication: keep its port closed to anything but this job's "
        "machines; see docs/reliability.md.")
