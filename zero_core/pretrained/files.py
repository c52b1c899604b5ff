"""Pretrained weight files, read a range at a time: what a rank reads is what it keeps.

A Hugging Face model directory (``model.safetensors``, ``model.safetensors.index.json`` with its shards,
``pytorch_model.bin`` or its index), one such file, or a list of them (what ``from_pretrained`` resolves).
A rank's shard of a safetensors tensor is, where nothing needs converting or padding (a CPU tensor of the file's
dtype), a copy-on-write view of the file's pages (private_pages.py), as ``from_pretrained`` without an engine
gives every parameter: nothing is copied or allocated while loading, a page becomes resident when first read
(from the page cache the ranks share) and a write stays private to the process. Otherwise the elements are read
with ``os.preadv`` straight into the destination, at the byte range of the elements asked for (the header, a
small JSON, says where each tensor sits); torch files through ``torch.load(..., weights_only=True, mmap=True)``,
so only the pages of the rows used are read and no code from the file runs. Only headers are read up front.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from zero_core.layout import Range
from zero_core.pretrained import private_pages

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

PathLike = Union[str, Path]
READ_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def resolve_weight_files(path: Union[PathLike, Sequence[PathLike]]) -> list[Path]:
    """The weight files a model directory, an index, a file or a list of files names."""
    if isinstance(path, (list, tuple)):
        return [Path(p) for p in path]
    path = Path(path)
    if path.is_file() and path.name.endswith(".index.json"):
        return _from_index(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no pretrained weights at '{path}': give a model directory (as save_pretrained "
                                "writes it), a .safetensors/.bin file, or an index .json")
    for index in (SAFETENSORS_INDEX, TORCH_INDEX):
        if (path / index).is_file():
            return _from_index(path / index)
    for name in _SINGLE_FILES:
        if (path / name).is_file():
            return [path / name]
    raise FileNotFoundError(f"'{path}' holds no {', '.join(_SINGLE_FILES)} and no {SAFETENSORS_INDEX} or "
                            f"{TORCH_INDEX}: is it the directory save_pretrained wrote?")


def _from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as error:
        raise ValueError(f"'{index}' is not a weight index (a JSON object with a 'weight_map'): {error}") from None
    return [index.parent / name for name in sorted(set(weight_map.values()))]


@dataclass(frozen=True)
class _Located:
    """Where a safetensors tensor's bytes sit: the file's byte offset of its first element."""

    fd: int
    offset: int


def _read_safetensors_header(file: Path) -> tuple[dict, int]:
    """The header (name -> dtype, shape, data_offsets) and where the data starts. The format is a little-endian
    u64 header length, that many bytes of JSON, then the data (safetensors' documented layout)."""
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"'{file}' is too short to be a safetensors file")
        length = int.from_bytes(prefix, "little")
        if length > min(file.stat().st_size - 8, 100 << 20):
            raise ValueError(f"'{file}' is not a safetensors file (its header length {length} is impossible)")
        try:
            header = json.loads(handle.read(length))
        except ValueError as error:
            raise ValueError(f"'{file}' is not a safetensors file (its header is not JSON: {error})") from None
    header.pop("__metadata__", None)
    return header, 8 + length


class WeightFiles:
    """Every tensor of a set of weight files by name: its header, a flat range of it, or all of it."""

    def __init__(self, files: Sequence[Path]):
        self._stack = contextlib.ExitStack()
        self._located: dict[str, _Located] = {}
        self._torch: dict[Path, dict] = {}
        self.info: dict[str, TensorInfo] = {}
        try:
            for file in files:
                self._read_header(Path(file))
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, path: Union[PathLike, Sequence[PathLike]]) -> "WeightFiles":
        return cls(resolve_weight_files(path))

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the files (a view :meth:`shard` returned stays valid: a mapping needs no open file)."""
        self._stack.close()
        self._located.clear()
        self._torch.clear()

    def _read_header(self, file: Path) -> None:
        if not file.is_file():
            raise FileNotFoundError(f"weight file '{file}' is missing (named by the index, or given)")
        if file.suffix == ".safetensors":
            header, data_start = _read_safetensors_header(file)
            fd = os.open(file, os.O_RDONLY)
            self._stack.callback(os.close, fd)
            size = file.stat().st_size
            for key, entry in header.items():
                dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
                begin, end = entry.get("data_offsets", (0, -1))
                shape = tuple(entry.get("shape", ()))
                if dtype is None or end - begin != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"tensor '{key}' in '{file}' has a damaged or unsupported header entry {entry}")
                if data_start + end > size:
                    raise ValueError(f"'{file}' is truncated: it has {size} bytes, but tensor '{key}' ends at byte "
                                     f"{data_start + end}. Copy or download it again")
                self.info[key] = TensorInfo(shape, dtype, file)
                self._located[key] = _Located(fd, data_start + begin)
            return
        # a torch file: weights_only never runs code from it; mmap reads only the pages that are used
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict):
            raise ValueError(f"'{file}' does not hold a state dict (a dict of tensors)")
        self._torch[file] = state
        for key, value in state.items():
            if torch.is_tensor(value):
                self.info[key] = TensorInfo(tuple(value.shape), value.dtype, file)

    def read(self, key: str, rng: Range) -> torch.Tensor:
        """Elements ``rng`` of tensor ``key`` flattened (1-d, the file's dtype)."""
        out = torch.empty(rng.size, dtype=self.info[key].dtype, device="cpu")  # not the default device: a read
        self.read_into(key, rng, out)
        return out

    def shard(self, key: str, rng: Range, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Elements ``rng`` of ``key`` (flattened) as a new 1-d tensor of ``size`` elements, zeros after the first
        ``rng.size``, of ``dtype`` on ``device``: a rank's shard of a parameter. A copy-on-write view of the file's
        pages where that needs no conversion or padding (see the module docstring), else read into new memory."""
        if size == rng.size and self._mappable(key, dtype, device):
            mapped = self._view(key, rng)
            if mapped is not None:
                return mapped
        out = torch.empty(size, dtype=dtype, device=device)
        out[rng.size:].zero_()
        self.read_into(key, rng, out[: rng.size])
        return out

    def _mappable(self, key: str, dtype: torch.dtype, device: torch.device) -> bool:
        info = self.info[key]
        return (info.file not in self._torch and dtype == info.dtype and torch.device(device).type == "cpu"
                and self._located[key].offset % dtype.itemsize == 0)  # elements aligned in the file, as torch expects

    def _view(self, key: str, rng: Range) -> Optional[torch.Tensor]:
        """Elements ``rng`` of safetensors tensor ``key``: a view of a private (copy-on-write) mapping of their
        pages; None if none can be made."""
        info, located = self.info[key], self._located[key]
        return private_pages.view(located.fd, located.offset + rng.start * info.dtype.itemsize, rng.size, info.dtype)

    def read_into(self, key: str, rng: Range, out: torch.Tensor) -> None:
        """Elements ``rng`` of ``key`` into ``out`` (1-d, any dtype on any device). From safetensors the bytes go
        straight into ``out`` when it is a CPU tensor of the file's dtype (one ``preadv``: nothing else is
        allocated or mapped), else through a bounded staging buffer."""
        info = self.info[key]
        if info.file in self._torch:
            out.copy_(self._torch[info.file][key].reshape(-1)[rng.as_slice()])
            return
        direct = out.device.type == "cpu" and out.dtype == info.dtype and out.is_contiguous()
        step = rng.size if direct else max(1, READ_CHUNK_BYTES // info.dtype.itemsize)
        for first in range(rng.start, rng.end, step):
            last = min(rng.end, first + step)
            target = out[first - rng.start: last - rng.start] if direct else \
                torch.empty(last - first, dtype=info.dtype, device="cpu")  # host staging, whatever the default device
            self._pread(key, first, target)
            if not direct:
                out[first - rng.start: last - rng.start].copy_(target)

    def _pread(self, key: str, first: int, target: torch.Tensor) -> None:
        located, itemsize = self._located[key], target.element_size()
        view = memoryview(target.view(torch.uint8).numpy()) if target.numel() else memoryview(b"")
        done, offset = 0, located.offset + first * itemsize
        while done < len(view):  # preadv may return short counts on large reads
            got = os.preadv(located.fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"'{self.info[key].file}' ends inside tensor '{key}': the file is truncated")
            done += got

    def read_whole(self, key: str) -> torch.Tensor:
        info = self.info[key]
        return self.read(key, Range(0, info.numel)).view(info.shape)
