"""The checkpoint's building blocks, in one process: the safetensors writer, sizes, client state, the atomic
directory swap, and the errors for paths that are not checkpoints."""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zero_core.checkpoint import files
from zero_core.checkpoint.format import CheckpointError, read_manifest, read_safetensors_header
from zero_core.checkpoint.hf_shards import parse_size
from zero_core.checkpoint.values import decode_value, encode_value, load_client_state, save_client_state


def test_writer_output_is_read_by_safetensors(tmp_path):
    base = torch.arange(10, dtype=torch.float32)
    tensors = [
        ("view", base[3:7]),  # views of one storage: safetensors' own writer refuses these
        ("same-storage", base[5:]),
        ("bf16", torch.randn(3, 2).to(torch.bfloat16)),
        ("int", torch.tensor([[1, -2]], dtype=torch.int64)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
    ]
    info = files.write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    loaded = load_file(tmp_path / "x.safetensors")
    for key, tensor in tensors:
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
        assert info["crc32"][key] == zlib.crc32(files.tensor_bytes(tensor))
    assert info["bytes"] == (tmp_path / "x.safetensors").stat().st_size
    assert info["sha256"] == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    start, header = read_safetensors_header(tmp_path / "x.safetensors")
    assert start % 8 == 0 and header["__metadata__"] == {"format": "pt"}


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("5 parsecs")


def test_values_round_trip():
    for value in (torch.tensor(3.0), (0.9, 0.999), [1, None, "x", True], torch.tensor(7, dtype=torch.int64)):
        decoded = decode_value(encode_value(value))
        if torch.is_tensor(value):
            assert decoded.dtype == value.dtype and torch.equal(decoded, value)
        else:
            assert decoded == value
    with pytest.raises(TypeError):
        encode_value(torch.zeros(3))


def test_client_state_round_trip_and_refusal(tmp_path):
    state = {"step": 5, "rng": torch.get_rng_state(), "nested": OrderedDict(a=[torch.ones(2), (1, "two")])}
    info = save_client_state(tmp_path, state)
    assert set(info) == {"client_state.pt", "client_state.safetensors"}
    loaded = load_client_state(tmp_path)
    assert loaded["step"] == 5 and torch.equal(loaded["rng"], state["rng"])
    assert torch.equal(loaded["nested"]["a"][0], torch.ones(2)) and loaded["nested"]["a"][1] == (1, "two")
    with pytest.raises(CheckpointError, match="weights_only"):
        save_client_state(tmp_path, {"object": Path("not/a/plain/value")})


def test_publish_replaces_only_complete_directories(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    for content, exchange in (("first", True), ("second", True), ("third", False)):
        if not exchange:  # the fallback without renameat2: old moved aside, new moved in, old deleted
            monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        temp = files.temp_sibling(target, f"{len(content):016x}")
        temp.mkdir()
        (temp / "manifest.json").write_text(content)
        files.check_replaceable(target)
        files.publish(temp, target)
        assert (target / "manifest.json").read_text() == content
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_paths_that_are_not_checkpoints(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        files.check_replaceable(tmp_path / "notes")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file"):
        files.check_replaceable(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="no checkpoint directory .* check the path"):
        read_manifest(tmp_path / "ckpt")
    unfinished = files.temp_sibling(tmp_path / "ckpt", "00ff")
    unfinished.mkdir()
    (unfinished / "manifest.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="unfinished save"):
        read_manifest(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="save that did not finish"):
        read_manifest(unfinished)
    files.remove_stale_temps(tmp_path / "ckpt")
    assert not unfinished.exists()
