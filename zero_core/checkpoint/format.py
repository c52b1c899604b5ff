"""The on-disk format of a sharded checkpoint: file names, tensor keys, dtype names, the manifest.

docs/checkpoint-format.md describes the same thing for readers without this library; keep the two in step.
A checkpoint is a directory:

    manifest.json                         written last: a directory without it is not a checkpoint
    shard-00000-of-00002.safetensors      rank 0's fp32 master fragments and per-element optimizer state
    shard-00001-of-00002.safetensors      rank 1's
    replicated.safetensors                what ZeRO does not shard (buffers, frozen parameters), from rank 0
    client_state.pt, client_state.safetensors   the caller's client_state: structure and tensors apart
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Union

import torch

FORMAT = "zero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPLICATED = "replicated.safetensors"
EXCLUDED = "excluded_frozen_parameters"  # the manifest's list of parameters a save left out (exclude_frozen_parameters)
CLIENT_STATE = "client_state.pt"
CLIENT_TENSORS = "client_state.safetensors"
MASTER_KIND = "fp32"  # the tensor kind of fp32 master weights; optimizer state kinds are the state keys

PathLike = Union[str, "os.PathLike[str]"]

# torch dtype <-> the names used in safetensors headers and in the manifest
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing a piece, is damaged, or cannot be read; the message names the file and tensor."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint and the model (or optimizer) do not describe the same parameters."""


def shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def tensor_key(name: str, start: int, end: int, kind: str) -> str:
    """Key of one fragment tensor inside a shard file, e.g. ``blocks.0.fc1.weight/0-495/exp_avg``."""
    return f"{name}/{start}-{end}/{kind}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest's spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def safetensors_dtype(dtype: torch.dtype) -> str:
    if dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors by this writer")
    return _SAFETENSORS_DTYPES[dtype]


def read_safetensors_header(path: PathLike) -> tuple[int, dict]:
    """(offset where tensor data starts, the JSON header) of a safetensors file, read without safetensors."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"'{path}' is not a safetensors file: it has {len(prefix)} bytes")
        (length,) = struct.unpack("<Q", prefix)
        raw = f.read(length) if length < 100_000_000 else b""
    if len(raw) != length:
        raise CheckpointError(f"'{path}': the safetensors header is damaged (length field {length})")
    try:
        return 8 + length, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"'{path}': the safetensors header is not valid JSON ({error})") from None


def checkpoint_missing_hint(path: Path) -> str:
    """Why ``path`` may be missing: an interrupted save leaves only a hidden temporary sibling."""
    partial = sorted(p.name for p in path.parent.glob(f".{path.name}.tmp-*")) if path.parent.is_dir() else []
    hint = f"no checkpoint directory at '{path}'"
    if partial:
        hint += (f"; found the unfinished save(s) {partial} next to it: a save was interrupted before it "
                 "completed, so no checkpoint was written (those directories are not loadable)")
    else:
        hint += "; check the path (a checkpoint is a directory written by save_checkpoint)"
    return hint


# The hidden directory a save writes into (files.temp_sibling); never a checkpoint, even with a manifest.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-[0-9a-f]+")


def read_manifest(path: PathLike) -> dict:
    """The parsed, checked manifest of the checkpoint directory ``path``."""
    path = Path(path)
    temporary = _TEMPORARY.fullmatch(path.name)
    if temporary:
        raise CheckpointError(
            f"'{path}' is the temporary directory of a save that did not finish: it is not a checkpoint. The "
            f"next save to '{temporary.group('name')}' deletes it; load '{temporary.group('name')}' instead")
    if not path.is_dir():
        if path.exists():
            raise CheckpointError(f"'{path}' is a file, not a checkpoint directory")
        raise FileNotFoundError(checkpoint_missing_hint(path))
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        from zero_core.checkpoint.foreign import KNOWN_FORMATS  # foreign/ imports this module

        raise CheckpointError(
            f"'{path}' is not a complete checkpoint: it has no {MANIFEST} (written last, so its absence means "
            "the save did not finish; load an earlier checkpoint), and it is not a foreign checkpoint this "
            f"library reads ({KNOWN_FORMATS})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"'{manifest_path}' is damaged: not valid JSON ({error})") from None
    _check_manifest(manifest, manifest_path)
    return manifest


def _check_manifest(manifest: Any, where: Path) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"'{where}' is not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"'{where}' has format_version {version!r}; this library reads up to "
                              f"{FORMAT_VERSION}: upgrade lightning-zero to read it")
    required = ("run", "files", "parameters", "replicated", "optimizer", "aliases")
    missing = [key for key in required if key not in manifest]
    if missing:
        raise CheckpointError(f"'{where}' lacks the entries {missing}")


def optimizer_classes(manifest: dict) -> list[str]:
    """The class of each optimizer, in the order given to setup (checkpoints of one optimizer name one)."""
    optimizer = manifest["optimizer"]
    return list(optimizer.get("classes", [optimizer["class"]]))


def group_optimizers(manifest: dict) -> list[int]:
    """For each saved parameter group, the index of the optimizer it belongs to."""
    return [group.get("optimizer", 0) for group in manifest["optimizer"]["param_groups"]]


def write_json(path: Path, data: Any) -> None:
    """Write JSON and fsync it, so it is on disk before anything that points to it."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
