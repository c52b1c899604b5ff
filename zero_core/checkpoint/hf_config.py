"""A Hugging Face ``config.json`` beside exported weights that names the dtype of the tensors written.

``from_pretrained`` (default ``dtype="auto"``) builds the model in the dtype its ``config.json`` names and casts
the stored tensors to it. A config that says ``bfloat16`` beside fp32 weights silently rounds the fine-tuned
model on load; one that says ``float32`` beside bf16 weights doubles its memory. So every export that writes a
config writes the dtype of its floating tensors into it (``dtype``, and ``torch_dtype`` where an older config
has that key). Plain JSON: no ``transformers`` import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from zero_core.checkpoint.files import atomic_file

CONFIG_NAME = "config.json"
ConfigSource = Union[str, "os.PathLike[str]", dict]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as ``save_pretrained`` writes it."""
    return str(dtype).removeprefix("torch.")


def floating_dtype(tensors: Iterable[torch.Tensor]) -> Optional[torch.dtype]:
    """The dtype most floating tensors (by elements) have; None without any."""
    counts: dict = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.get) if counts else None


def read_config(source: ConfigSource) -> dict:
    """``source``: a config dict, a ``config.json`` file, or a directory holding one (the model's own)."""
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path}: pass a config.json, its directory, or a dict")
    return json.loads(path.read_text())


def write_config(source: ConfigSource, out_dir: Union[str, "os.PathLike[str]"], dtype: torch.dtype) -> Path:
    """Write ``out_dir/config.json``: ``source``'s config naming ``dtype``. Replaces the file atomically."""
    config = read_config(source)
    config["dtype"] = dtype_name(dtype)
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name(dtype)
    target = Path(out_dir) / CONFIG_NAME
    with atomic_file(target) as temp:
        Path(temp).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return target
