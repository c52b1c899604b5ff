"""Non-tensor state in JSON, and client_state split into a tensor-free structure plus safetensors.

Scalar optimizer state (Adam's ``step``) and hyper-parameters are small, so they live in the manifest as JSON.
A 0-d tensor keeps its dtype: ``{"tensor": 5.0, "dtype": "float32"}``; a tuple is ``{"tuple": [...]}``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from zero_core.checkpoint.files import fsync_path, sha256_file, write_safetensors
from zero_core.checkpoint.format import CLIENT_STATE, CLIENT_TENSORS, CheckpointError, dtype_from_name, dtype_name

_TENSOR_MARK = "__zero_checkpoint_tensor__"


def encode_value(value: Any) -> Any:
    """A JSON form of a scalar, a 0-d tensor, or a (nested) list/tuple of them; raises TypeError otherwise."""
    if torch.is_tensor(value):
        if value.numel() != 1 or value.dim() != 0:
            raise TypeError(f"a tensor of shape {tuple(value.shape)} is not a scalar")
        return {"tensor": value.item(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} is not stored in checkpoint JSON")


def decode_value(value: Any, device: torch.device = torch.device("cpu")) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=dtype_from_name(value["dtype"]), device=device)
    if isinstance(value, dict) and "tuple" in value:
        return tuple(decode_value(v, device) for v in value["tuple"])
    if isinstance(value, list):
        return [decode_value(v, device) for v in value]
    return value


def encode_hyperparameters(group: dict, index: int) -> dict:
    """Every JSON-storable entry of an optimizer group but "params"; others are skipped with a warning."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        try:
            out[key] = encode_value(value)
        except TypeError as error:
            warnings.warn(f"optimizer param_groups[{index}][{key!r}] is not saved in the checkpoint: {error}",
                          stacklevel=4)
    return out


# -- client_state ----------------------------------------------------------------------------------------


def _split(value: Any, tensors: dict) -> Any:
    if torch.is_tensor(value):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().cpu()
        return {_TENSOR_MARK: key}
    if isinstance(value, dict):
        return type(value)((k, _split(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _merge(value: Any, tensors: dict) -> Any:
    if isinstance(value, dict) and set(value) == {_TENSOR_MARK}:
        return tensors[value[_TENSOR_MARK]]
    if isinstance(value, dict):
        return type(value)((k, _merge(v, tensors)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_merge(v, tensors) for v in value)
    return value


def save_client_state(directory: Path, client_state: Any) -> dict:
    """Write the tensors to safetensors and the rest with torch.save; returns {file name: info}."""
    tensors: dict = {}
    skeleton = _split(client_state, tensors)
    structure = directory / CLIENT_STATE
    torch.save(skeleton, structure)
    try:  # fail now, not at resume time, on anything weights_only loading refuses (custom classes)
        torch.load(structure, weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"client_state holds something that cannot be loaded safely (weights_only=True): {error}. Store "
            "plain containers, numbers, strings and tensors (e.g. an object's state_dict(), not the object)"
        ) from None
    info = {CLIENT_STATE: _file_info(structure)}
    written = write_safetensors(directory / CLIENT_TENSORS, sorted(tensors.items()))
    info[CLIENT_TENSORS] = {"bytes": written["bytes"], "sha256": written["sha256"]}
    return info


def _file_info(path: Path) -> dict:
    fsync_path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def load_client_state(directory: Path) -> Any:
    """A checkpoint's client_state alone, read without a process group (tensors from safetensors, the rest
    with weights_only=True); e.g. to convert a checkpoint into another framework's file."""
    directory = Path(directory)
    skeleton = torch.load(directory / CLIENT_STATE, weights_only=True)
    return _merge(skeleton, load_file(directory / CLIENT_TENSORS))
