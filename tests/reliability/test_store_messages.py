"""Nothing read from the rendezvous store is executed: the collective guard's messages are JSON in a fixed schema
(zero_core/comm/wire.py), and a value that is anything else stops the job with an error naming the key and the
rank it belongs to, on every rank. The store has no authentication, so these are what an outsider could write."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import zero_core
from distributed import run_distributed
from zero_core.comm.wire import (
    MAX_BYTES,
    MAX_HEARTBEAT,
    Call,
    decode_failure,
    decode_heartbeat,
    decode_history,
    decode_whereabouts,
    encode_failure,
    encode_heartbeat,
    encode_whereabouts,
)


class _CreatesFile:
    """Unpickling this object opens (creates) ``path``: a stand-in for any code an attacker could run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def crafted_pickle(marker: Path) -> bytes:
    return pickle.dumps(_CreatesFile(str(marker)))


def test_the_crafted_pickle_would_run_code_if_unpickled(tmp_path):
    """The control: the payload the tests below plant does create its marker when unpickled."""
    marker = tmp_path / "control"
    pickle.loads(crafted_pickle(marker)).close()
    assert marker.exists()


CALLS = (Call(0, "all_gather", 4096, "float32", "blocks.7", 0), Call(1, "reduce_scatter", 12, "bfloat16", "", 0))
NOTE = {"where": "barrier", "seq": 2, "fingerprint": -(2**62), "step": 0, "history": CALLS, "notes": [True]}
STATUS = {"where": "collective", "seq": 1, "call": CALLS[1], "step": 0, "history": CALLS}


def test_whereabouts_round_trip_as_plain_json():
    for message, notes in ((NOTE, 1), (STATUS, None)):
        raw = encode_whereabouts(message)
        json.loads(raw)  # plain JSON, nothing else
        back = decode_whereabouts(raw, "step/0/1", 1, notes)
        assert back == {**message, "history": list(CALLS)}
        assert all(type(c) is Call for c in back["history"]) and back["history"][0].describe().startswith("all_gather")


def _malformed(raw: bytes, notes=None) -> str:
    with pytest.raises(zero_core.StoreMessageError) as caught:
        decode_whereabouts(raw, "zero_core/guard/0-1/0/status/1", 1, notes)
    return str(caught.value)


@pytest.mark.parametrize("raw, problem", [
    (pickle.dumps({"where": "barrier"}), "not UTF-8 JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'{"where": ["barrier"]}', "unexpected fields"),
    (json.dumps({**STATUS, "extra": 1}).encode(), "unexpected fields"),
    (json.dumps({**STATUS, "seq": True}).encode(), "field 'seq' is not a int"),
    (json.dumps({**STATUS, "seq": -1}).encode(), "out of range"),
    (json.dumps({**STATUS, "call": [1, "x"]}).encode(), "not a collective record"),
    (json.dumps({**STATUS, "history": [[0, "k", 1.5, "f", "x", 0]]}).encode(), "not a collective record"),
    (json.dumps({**STATUS, "where": "collective" * 200}).encode(), "unexpected fields"),
    (json.dumps({**NOTE, "notes": [{"a": 1}]}).encode(), "a note is not"),
    (b"[" * 100000 + b"]" * 100000, f"more than the {MAX_BYTES} allowed"),
    (b"[" * 30000 + b"]" * 30000, "not UTF-8 JSON"),  # deeper than the parser's recursion limit
    (b'{"seq": ' + b"9" * 5000 + b"}", "not UTF-8 JSON"),  # past Python's digit limit for int()
])
def test_a_malformed_value_is_an_error_naming_key_and_rank(raw, problem):
    message = _malformed(raw)
    assert "rank 1's key 'zero_core/guard/0-1/0/status/1'" in message and problem in message, message
    assert "Nothing of it was run" in message


def test_a_history_left_for_later_is_checked_when_decoded():
    bad = {**NOTE, "history": [list(CALLS[0]), [0, "k", "many", "f", "x", 0]]}
    note = decode_whereabouts(json.dumps(bad).encode(), "step/0/1", 1, 1, history=False)
    assert note["seq"] == 2 and note["history"][0] == list(CALLS[0])
    with pytest.raises(zero_core.StoreMessageError, match="rank 1's key 'step/0/1'.*not a collective record"):
        decode_history(note["history"], "step/0/1", 1)
    assert "more than 64 entries" in _malformed(json.dumps({**NOTE, "history": [list(CALLS[0])] * 65}).encode())


def test_a_status_under_a_step_key_or_a_wrong_number_of_notes_is_refused():
    assert "not a step note with 1" in _malformed(encode_whereabouts(STATUS), notes=1)
    assert "not a step note with 2" in _malformed(encode_whereabouts(NOTE), notes=2)


def test_very_long_module_names_are_cut_to_fit_the_size_limit():
    long = tuple(c._replace(label="m" * 5000) for c in CALLS) * 8
    raw = encode_whereabouts({**NOTE, "history": long})
    assert len(raw) <= MAX_BYTES
    assert decode_whereabouts(raw, "step/0/1", 1, 1)["history"][0].label == "m" * 256


def test_a_step_hook_note_must_be_plain_data():
    with pytest.raises(TypeError, match="step hook's note must be a bool, number, string or None, got object"):
        encode_whereabouts({**NOTE, "notes": [object()]})


def test_a_posted_failure_round_trips_and_a_pickled_one_is_refused(tmp_path):
    raw = encode_failure(1, zero_core.CollectiveMismatchError, "collective mismatch: rank 1 ...")
    assert decode_failure(raw, "failure") == (zero_core.CollectiveMismatchError, "collective mismatch: rank 1 ...")
    marker = tmp_path / "marker"
    for bad in (crafted_pickle(marker), json.dumps({"rank": 0, "error": "SystemExit", "message": "x"}).encode()):
        with pytest.raises(zero_core.StoreMessageError, match="the key 'ns/failure'"):
            decode_failure(bad, "ns/failure")
    assert not marker.exists()


BEAT = {"seq": 7, "last": CALLS[0], "idle_s": 1.5, "waiting": False, "stack": "train.py:29 in f: time.sleep(1)",
        "pid": 4242, "host": "node-3", "sent": 1.7e9}


def test_a_heartbeat_round_trips_as_plain_json():
    for beat in (BEAT, {**BEAT, "last": None}):
        raw = encode_heartbeat(**beat)
        json.loads(raw)
        back = decode_heartbeat(raw, "ns/alive/1", 1)
        assert back == beat and (back["last"] is None or type(back["last"]) is Call)


def test_a_long_stack_is_cut_to_fit_a_heartbeat():
    for stack in ("x" * 50000, "\u00e9" * 50000, "\U0001F600" * 50000):
        raw = encode_heartbeat(**{**BEAT, "stack": stack, "host": "h" * 1000, "last": CALLS[0]._replace(label="m" * 5000)})
        assert len(raw) <= MAX_HEARTBEAT
        back = decode_heartbeat(raw, "ns/alive/1", 1)
        assert back["stack"].startswith(stack[:100]) and back["stack"].endswith("...")
        assert back["host"] == "h" * 255 and back["last"].label == "m" * 256


@pytest.mark.parametrize("raw, problem", [
    (pickle.dumps(BEAT), "not UTF-8 JSON"),
    (b"[1]", "not a JSON object with exactly the fields"),
    (json.dumps({**BEAT, "last": None, "extra": 1}).encode(), "exactly the fields"),
    (json.dumps({k: v for k, v in BEAT.items() if k not in ("last", "pid")}).encode(), "exactly the fields"),
    (json.dumps({**BEAT, "last": None, "seq": True}).encode(), "field 'seq' is not a int"),
    (json.dumps({**BEAT, "last": None, "idle_s": 2}).encode(), "field 'idle_s' is not a float"),
    (json.dumps({**BEAT, "last": None, "idle_s": float("nan")}).encode(), "not a finite number"),
    (json.dumps({**BEAT, "last": None, "waiting": 0}).encode(), "field 'waiting' is not a bool"),
    (json.dumps({**BEAT, "last": [1, "x"]}).encode(), "not a collective record"),
    (json.dumps({**BEAT, "last": None, "pid": -1}).encode(), "out of range"),
    (json.dumps({**BEAT, "last": None, "host": "h" * 300}).encode(), "longer than 255"),
    (json.dumps({**BEAT, "last": None, "stack": "s" * MAX_HEARTBEAT}).encode(), f"more than the {MAX_HEARTBEAT}"),
])
def test_a_malformed_heartbeat_is_an_error_naming_key_and_rank(raw, problem):
    with pytest.raises(zero_core.StoreMessageError) as caught:
        decode_heartbeat(raw, "zero_core/guard/0-1/0/alive/1", 1)
    message = str(caught.value)
    assert "rank 1's key 'zero_core/guard/0-1/0/alive/1'" in message and problem in message, message


# -- a crafted pickle planted in a running job ------------------------------------------------------------
def _plant_pickle_at_the_first_step(rank: int, world_size: int, marker: str) -> dict:
    """Rank 1 posts its step note; before rank 0 posts its own, an outsider (played by rank 0, on its own store
    connection) overwrites rank 1's note with a crafted pickle. Both ranks read it at the step barrier."""
    model = torch.nn.Linear(4, 2)
    engine = zero_core.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 2})
    engine.backward(model(torch.ones(3, 4)).sum())
    started = time.monotonic()
    if rank == 0:
        guard = engine.comm.guard
        outsider = torch.distributed.PrefixStore(guard._namespace,
                                                 torch.distributed.distributed_c10d._get_default_store().clone())
        outsider.wait(["step/0/1"])
        outsider.set("step/0/1", crafted_pickle(Path(marker)))
    try:
        engine.step()
    except zero_core.StoreMessageError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def test_a_pickle_planted_under_a_guard_key_never_runs_and_stops_every_rank(tmp_path):
    marker = tmp_path / "marker"
    results = run_distributed(_plant_pickle_at_the_first_step, 2, str(marker), timeout=90)
    assert not marker.exists(), "the planted pickle was unpickled"
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not stop"
        assert "rank 1's key 'zero_core/guard/0-1/" in result["error"] and "/step/0/1'" in result["error"], result
        assert "not UTF-8 JSON" in result["error"] and result["seconds"] < 30


def _plant_pickle_in_a_heartbeat(rank: int, world_size: int, marker: str) -> dict:
    """Rank 1 reaches the step barrier 4 s late; meanwhile an outsider (a thread of rank 0, on its own store
    connection) keeps overwriting rank 1's heartbeat with a crafted pickle (rank 1's guard thread re-posts the
    real one twice a second). Rank 0, stalled at the barrier after 1 s, reads rank 1's heartbeat to tell a stuck
    rank from a slow one, and posts the error as the job's failure. Rank 1 passes the barrier (rank 0's note is
    there) and blocks in the step's reduce-scatter; its guard thread keeps the posted failure once that stalls
    (it posts its status first), and it raises it when rank 0 (which hosts the store) exits."""
    os.environ["ZERO_CORE_GUARD_STALL_S"] = "1"
    model = torch.nn.Linear(4, 2)
    engine = zero_core.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 2})
    stop = threading.Event()
    if rank == 0:
        outsider = torch.distributed.PrefixStore(engine.comm.guard._namespace,
                                                 torch.distributed.distributed_c10d._get_default_store().clone())

        def plant() -> None:
            while not stop.is_set():
                outsider.set("alive/1", crafted_pickle(Path(marker)))
                stop.wait(0.005)

        threading.Thread(target=plant, daemon=True).start()
    started = time.monotonic()
    try:
        for _ in range(3):
            engine.backward(model(torch.ones(3, 4)).sum())
            if rank == 1:
                time.sleep(4)
            engine.step()
    except zero_core.StoreMessageError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    finally:
        stop.set()
        if rank == 0:  # until rank 1's guard has read the failure
            outsider.wait(["status/1"], timedelta(seconds=60))
            time.sleep(1)
    return {"error": None}


def test_a_pickle_planted_under_a_heartbeat_key_never_runs_and_stops_every_rank(tmp_path):
    marker = tmp_path / "marker"
    results = run_distributed(_plant_pickle_in_a_heartbeat, 2, str(marker), timeout=90)
    assert not marker.exists(), "the planted pickle was unpickled"
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not stop"
        assert "rank 1's key 'zero_core/guard/0-1/" in result["error"] and "/alive/1'" in result["error"], result
        assert "not UTF-8 JSON" in result["error"] and result["seconds"] < 30


# -- the other exchanges between ranks: JSON in byte tensors, not all_gather_object's pickle ------------------
def _gather_plain(rank: int, world_size: int) -> list:
    from zero_core.comm.plain_exchange import all_gather_json

    return all_gather_json(["rank", rank, {"node": "x" * (rank * 100)}, (1, 2)])


def test_all_gather_json_exchanges_plain_data_of_different_sizes():
    results = run_distributed(_gather_plain, 2, timeout=60)
    expected = [["rank", r, {"node": "x" * (r * 100)}, [1, 2]] for r in range(2)]
    assert results == [expected, expected]


def test_all_gather_json_refuses_what_is_not_json(tmp_path):
    from zero_core.comm.plain_exchange import _parse

    marker = tmp_path / "marker"
    with pytest.raises(RuntimeError, match="rank 1 sent [0-9]+ bytes that are not UTF-8 JSON"):
        _parse(crafted_pickle(marker), 1)
    assert not marker.exists()
