"""Turn a ``ZeroAccelerator.save_state`` directory into one plain Accelerate can ``load_state``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Union

import torch
from safetensors.torch import save_file

import zero_core

from .state_io import ZERO_STATE_FILE, suffix

PathLike = Union[str, "os.PathLike[str]"]


def export_accelerate_state(checkpoint: PathLike, out: PathLike) -> Path:
    """Write ``out``: Accelerate's own files copied from ``checkpoint``, plus for each ZeRO model a full fp32
    ``model[_i].safetensors`` and a plain ``optimizer[_i].bin``, named as Accelerate's ``save_state`` names
    them (it saves the unwrapped model, so DDP and single-process runs read the same files).

    Runs offline, in one process; the whole model and optimizer state are held in memory once.
    """
    source, out = Path(checkpoint), Path(out)
    info_file = source / ZERO_STATE_FILE
    if not info_file.is_file():
        raise FileNotFoundError(f"{source} has no {ZERO_STATE_FILE}: it is not a ZeroAccelerator.save_state directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != ZERO_STATE_FILE:
            shutil.copy2(item, out / item.name)
    for entry in json.loads(info_file.read_text())["models"]:
        sharded = source / entry["dir"]
        # tied weights once (safetensors refuses shared tensors), as Accelerate's own save_state writes them
        tensors = zero_core.consolidated_state_dict(sharded, dtype="fp32", tied_weights=False)
        save_file(tensors, str(out / f"model{suffix(entry['model_index'])}.safetensors"), metadata={"format": "pt"})
        indices = entry.get("optimizer_indices", [entry.get("optimizer_index")])  # older files: one optimizer
        if all(i is not None for i in indices):
            for index, state in zip(indices, zero_core.read_optimizer_states(sharded)):
                torch.save(state, out / f"optimizer{suffix(index)}.bin")
    return out
