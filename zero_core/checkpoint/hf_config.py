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
from typing import Optional, Union

import torch

from zero_core.checkpoint.files import atomic_file

CONFIG_NAME = "config.json"
ConfigSource = Union[str, "os.PathLike[str]", dict]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as ``save_pretrained`` writes it."""
    return str(dtype).removeprefix("torch.")


class DtypeTally:
    """Floating elements written per dtype, counted as tensors stream past (none is kept): the model's dtype is
    the one most elements have (a buffer kept in fp32 beside bf16 weights does not decide it)."""

    def __init__(self) -> None:
        self.elements: dict[torch.dtype, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            self.elements[tensor.dtype] = self.elements.get(tensor.dtype, 0) + tensor.numel()

    def most(self) -> Optional[torch.dtype]:
        return max(self.elements, key=self.elements.get) if self.elements else None


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
