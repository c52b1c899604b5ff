"""Pretrained weight files, read a range at a time: what a rank reads is what it keeps.

A Hugging Face model directory (``model.safetensors``, ``model.safetensors.index.json`` with its shards,
``pytorch_model.bin`` or its index), one such file, or a list of them (what ``from_pretrained`` resolves).
Safetensors files are read through ``safe_open(...).get_slice``, which reads only the rows asked for; torch
files through ``torch.load(..., weights_only=True, mmap=True)``, so only the pages of the rows used are read and
no code from the file runs. Only headers are read up front.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from safetensors import safe_open

from zero_core.layout import Range

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

PathLike = Union[str, Path]


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


class WeightFiles:
    """Every tensor of a set of weight files by name: its header, a flat range of it, or all of it."""

    def __init__(self, files: Sequence[Path]):
        self._stack = contextlib.ExitStack()
        self._safetensors: dict[Path, Any] = {}
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
        self._stack.close()
        self._safetensors.clear()
        self._torch.clear()

    def _read_header(self, file: Path) -> None:
        if not file.is_file():
            raise FileNotFoundError(f"weight file '{file}' is missing (named by the index, or given)")
        if file.suffix == ".safetensors":
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as error:
                raise ValueError(f"cannot read '{file}' as safetensors: {error}") from None
            self._safetensors[file] = handle
            for key in handle.keys():
                piece = handle.get_slice(key)
                self.info[key] = TensorInfo(tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()], file)
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
        """Elements ``rng`` of tensor ``key`` flattened (1-d, the file's dtype), reading only the rows holding them."""
        info = self.info[key]
        if info.file in self._torch:
            return self._torch[info.file][key].reshape(-1)[rng.as_slice()].clone()
        piece = self._safetensors[info.file].get_slice(key)
        if len(info.shape) == 0:
            return piece[...].reshape(-1)[rng.as_slice()]
        row = math.prod(info.shape[1:]) or 1
        first, last = rng.start // row, -(-rng.end // row)
        block = piece[first:last].reshape(-1)
        return block[rng.start - first * row: rng.end - first * row]

    def read_whole(self, key: str) -> torch.Tensor:
        info = self.info[key]
        return self.read(key, Range(0, info.numel)).view(info.shape)
