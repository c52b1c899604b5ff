"""Hugging Face-style sharded safetensors output: ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` mapping each tensor name to its file.

Tensors are added one at a time and a file is written as soon as the next tensor would push it past
``max_shard_size``, so at most one output shard is held in memory. The count in the file names is only known
at the end, so files are written under temporary names and renamed by :meth:`finish`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Union

import torch

from zero_core.checkpoint.files import write_safetensors
from zero_core.checkpoint.format import CheckpointError, write_json

INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """``5GB`` -> 5_000_000_000 (decimal units, as Hugging Face uses them; KiB/MiB/GiB are binary)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {size!r}: use a number of bytes or e.g. '500MB', '5GB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[unit])


class ShardedWriter:
    """Collects tensors into output shards of at most ``max_bytes`` (one larger tensor gets a file alone)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str], int]] = []  # (temporary file, names, file bytes)
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending.append((name, tensor.contiguous()))
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        temporary = f"part-{len(self._written):05d}.safetensors"
        info = write_safetensors(self.directory / temporary, self._pending, {"format": "pt"})
        self._written.append((temporary, [n for n, _ in self._pending], info["bytes"]))
        self._pending, self._pending_bytes = [], 0

    def finish(self, metadata: dict) -> dict:
        """Write the last shard, give every file its final name, write the index, check sizes; return the index."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        weight_map = {}
        for number, (temporary, names, nbytes) in enumerate(self._written, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.rename(self.directory / temporary, self.directory / final)
            if (self.directory / final).stat().st_size != nbytes:
                raise CheckpointError(f"'{self.directory / final}' has the wrong size after writing: disk full?")
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_size, **metadata}, "weight_map": weight_map}
        write_json(self.directory / INDEX, index)
        return index


def read_index(directory: Union[str, "os.PathLike[str]"]) -> dict:
    return json.loads((Path(directory) / INDEX).read_text())
