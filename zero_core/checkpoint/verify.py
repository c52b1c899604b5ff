"""Checks that a checkpoint's files are the ones its manifest describes; errors name the file and the tensor.

The manifest records each file's size and SHA-256 and each tensor's CRC-32. The size check is a ``stat``;
the SHA-256 reads the file once. Only on a mismatch are the tensors' CRC-32s computed, to name the damage.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Iterable

from zero_core.checkpoint.files import sha256_file
from zero_core.checkpoint.format import CheckpointError, read_safetensors_header

_SHOWN = 5  # tensors listed in one error message


def tensors_in_file(manifest: dict, file: str) -> dict[str, dict]:
    """Key -> {"crc32", "what"} of every tensor the manifest places in ``file``."""
    found = {}
    for param in manifest["parameters"]:
        for fragment in param["fragments"]:
            if fragment["file"] == file:
                for kind, entry in fragment["tensors"].items():
                    found[entry["key"]] = {"crc32": entry["crc32"], "what": f"{kind} of parameter '{param['name']}'"}
    if file == "replicated.safetensors":
        for entry in manifest["replicated"]:
            found[entry["key"]] = {"crc32": entry["crc32"], "what": f"'{entry['name']}'"}
    return found


def verify_files(directory: Path, manifest: dict, files: Iterable[str], checksum: bool = True) -> None:
    for file in files:
        verify_file(directory, manifest, file, checksum)


def verify_file(directory: Path, manifest: dict, file: str, checksum: bool = True) -> None:
    expected = manifest["files"][file]
    path = directory / file
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' is missing; it holds {_contents(manifest, file)}")
    size = path.stat().st_size
    if size < expected["bytes"]:
        raise CheckpointError(f"checkpoint file '{path}' is truncated: it has {size} bytes, the manifest says "
                              f"{expected['bytes']}; {_cut_tensors(path, size, manifest, file)}")
    if size != expected["bytes"]:
        raise CheckpointError(f"size mismatch: checkpoint file '{path}' has {size} bytes, the manifest says "
                              f"{expected['bytes']} (it was replaced or appended to)")
    if checksum and sha256_file(path) != expected["sha256"]:
        raise CheckpointError(f"checkpoint file '{path}' is corrupted: its SHA-256 differs from the manifest's; "
                              f"{_damaged_tensors(path, manifest, file)}")


def _contents(manifest: dict, file: str) -> str:
    tensors = tensors_in_file(manifest, file)
    if not tensors:
        return "the client state" if file.startswith("client_state") else "no tensors"
    shown = [t["what"] for t in list(tensors.values())[:_SHOWN]]
    more = f" and {len(tensors) - _SHOWN} more" if len(tensors) > _SHOWN else ""
    return f"{len(tensors)} tensors: {', '.join(shown)}{more}"


def _header_or_none(path: Path):
    try:
        return read_safetensors_header(path)
    except CheckpointError:
        return None


def _cut_tensors(path: Path, size: int, manifest: dict, file: str) -> str:
    parsed = _header_or_none(path)
    if parsed is None:
        return "even its header is cut"
    start, header = parsed
    known = tensors_in_file(manifest, file)
    cut = [key for key, entry in header.items()
           if key != "__metadata__" and start + entry["data_offsets"][1] > size]
    named = [f"tensor '{key}' ({known.get(key, {}).get('what', 'not in the manifest')})" for key in cut[:_SHOWN]]
    return f"{len(cut)} tensors lie past its end, first {', '.join(named)}"


def _damaged_tensors(path: Path, manifest: dict, file: str) -> str:
    parsed = _header_or_none(path)
    if parsed is None:
        return "its safetensors header is damaged"
    start, header = parsed
    known = tensors_in_file(manifest, file)
    bad = []
    with open(path, "rb") as f:
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if key not in known or _crc32_of(f, start + begin, end - begin) != known[key]["crc32"]:
                bad.append(f"tensor '{key}' ({known.get(key, {}).get('what', 'not in the manifest')})")
    if not bad:
        return "the tensor data is intact, so the damage is in its header"
    return f"damaged: {', '.join(bad[:_SHOWN])}" + (f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")


def _crc32_of(f, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc
