"""Offline consolidation: a sharded checkpoint -> one model in Hugging Face-style safetensors shards, and the
optimizer state as a plain torch ``optimizer.state_dict()`` for a DDP resume.

No process group and no pickled classes are needed. Consolidation streams: one parameter is assembled from
its fragments, converted, and handed to the shard writer, so the peak is about the largest tensor plus one
output shard (benchmarks/consolidation_memory.py measures it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from tqdm.auto import tqdm

from zero_core.layout import Range
from zero_core.optim.weights_ema import EMA_KIND

from zero_core.checkpoint.files import atomic_directory, atomic_file
from zero_core.checkpoint.format import (MASTER_KIND, CheckpointError, PathLike, group_optimizers, optimizer_classes,
                                         read_manifest)
from zero_core.checkpoint.hf_config import ConfigSource, write_config
from zero_core.checkpoint.hf_shards import INDEX, ShardedWriter, parse_size
from zero_core.checkpoint.node_local import require_whole
from zero_core.checkpoint.sources import ShardedSource
from zero_core.checkpoint.verify import verify_files

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DtypeName = Literal["fp32", "bf16", "fp16"]


def consolidate(path: PathLike, out: PathLike, dtype: DtypeName = "fp32", max_shard_size: Union[int, str] = "5GB",
                verify: bool = True, progress: bool = True, hf_config: Optional[ConfigSource] = None,
                weights_ema: bool = False) -> Path:
    """Write the model of checkpoint ``path`` to directory ``out`` as sharded safetensors plus an index.

    Floating tensors are cast to ``dtype`` (from the fp32 masters); tied weights are written once, under their
    first name, and listed in the index's ``metadata.tied_weights``. ``hf_config`` (the model's ``config.json``,
    its directory, or a dict): written beside the weights naming ``dtype``, so ``from_pretrained`` loads them
    as written. ``weights_ema``: write the moving average of the weights the checkpoint holds
    (``weights_ema_decay``) instead of the trained weights; buffers are written as they are. ``out`` appears
    only when complete.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path, out = Path(path), Path(out).absolute()
    max_bytes = parse_size(max_shard_size)
    manifest = _checked_manifest(path, verify)
    kind = _weights_kind(path, manifest, weights_ema)
    with atomic_directory(out, marker=INDEX) as temp:
        _write_model(path, manifest, temp, DTYPES[dtype], max_bytes, progress, dtype, kind)
        if hf_config is not None:
            write_config(hf_config, temp, DTYPES[dtype])
    return out


def consolidated_state_dict(path: PathLike, dtype: DtypeName = "fp32", tied_weights: bool = True,
                            verify: bool = True, weights_ema: bool = False) -> dict[str, torch.Tensor]:
    """The model of checkpoint ``path`` as one state dict of CPU tensors, held whole in memory (for a model
    too large for that, :func:`consolidate` streams it to files). No process group needed.

    Floating tensors are cast to ``dtype`` from the fp32 masters. ``tied_weights``: a tied weight appears under
    each of its names, as ``module.state_dict()`` has it; False: once, under its first name (safetensors
    refuses tensors that share memory). ``weights_ema``: the parameters' moving average (``weights_ema_decay``)
    instead of the trained weights."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    path = Path(path)
    manifest = _checked_manifest(path, verify)
    kind = _weights_kind(path, manifest, weights_ema)
    with ShardedSource(path, manifest) as source:
        state = dict(_whole_tensors(source, _tensor_names(manifest), DTYPES[dtype], progress=False, kind=kind))
    if tied_weights:
        for alias, canonical in manifest["aliases"].items():
            state[alias] = state[canonical]
    return state


def _checked_manifest(path: Path, verify: bool) -> dict:
    manifest = read_manifest(path)
    require_whole(manifest, path)
    verify_files(path, manifest, sorted(manifest["files"]), checksum=verify)
    return manifest


def _weights_kind(path: Path, manifest: dict, weights_ema: bool) -> str:
    """Which stored values are the weights to write: the masters, or (``weights_ema``) their moving average."""
    if not weights_ema:
        return MASTER_KIND
    if manifest.get("weights_ema") is None:
        raise CheckpointError(
            f"the checkpoint {path} holds no moving average of the weights: it was saved by an engine without "
            "zero_optimization.weights_ema_decay. Consolidate its trained weights (leave out --weights_ema), or "
            "train with weights_ema_decay set"
        )
    return EMA_KIND


def _tensor_names(manifest: dict) -> list[str]:
    return [p["name"] for p in manifest["parameters"]] + [r["name"] for r in manifest["replicated"]]


def _whole_tensors(source: ShardedSource, names: list[str], dtype: torch.dtype, progress: bool,
                   kind: str = MASTER_KIND):
    """(name, whole tensor) one at a time, floating ones cast to ``dtype``; parameters' values of ``kind``."""
    for name in tqdm(names, desc="consolidating", unit="tensor", disable=not progress):
        tensor = source.read_whole(name, kind)
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)  # the fp32 copy goes now
        yield name, tensor
        del tensor  # before the next read: only the consumer (a shard writer) keeps it


def _write_model(path: Path, manifest: dict, temp: Path, dtype: torch.dtype, max_bytes: int, progress: bool,
                 dtype_label: str, kind: str = MASTER_KIND) -> None:
    names = _tensor_names(manifest)
    writer = ShardedWriter(temp, max_bytes)
    with ShardedSource(path, manifest) as source:
        for name, tensor in _whole_tensors(source, names, dtype, progress, kind):
            writer.add(name, tensor)
    index = writer.finish({"dtype": dtype_label, "tied_weights": manifest["aliases"],
                           "weights": "ema" if kind == EMA_KIND else "trained",
                           "source_checkpoint": str(path.absolute())})
    if sorted(index["weight_map"]) != sorted(names):
        raise CheckpointError(f"consolidation wrote {len(index['weight_map'])} tensors, expected {len(names)}")


def export_optimizer_state(path: PathLike, out: PathLike, verify: bool = True) -> Path:
    """Write the checkpoint's optimizer state as a plain torch ``optimizer.state_dict()`` file at ``out``.

    Its integer ids follow the original optimizer's groups (``param_names`` in the manifest), so
    ``optimizer.load_state_dict(torch.load(out, weights_only=True))`` works for an optimizer built over the
    same parameters in the same order (e.g. for a DDP resume). A checkpoint of several optimizers gives a list
    of state dicts, one per optimizer in their order. The whole state is held in memory.
    """
    states = read_optimizer_states(path, verify=verify)
    state_dict = states[0] if len(states) == 1 else states
    out = Path(out)
    with atomic_file(out) as partial:
        torch.save(state_dict, partial)
    return out


def read_optimizer_states(path: PathLike, verify: bool = True) -> list[dict]:
    """The checkpoint's optimizer state as plain ``optimizer.state_dict()`` dicts, one per optimizer."""
    path = Path(path)
    manifest = _checked_manifest(path, verify)
    with ShardedSource(path, manifest) as source:
        return plain_optimizer_states(source, manifest)


def plain_optimizer_states(source: ShardedSource, manifest: dict) -> list[dict]:
    """One plain ``optimizer.state_dict()`` per optimizer of the checkpoint."""
    owners = group_optimizers(manifest)
    states = []
    for k in range(len(optimizer_classes(manifest))):
        groups = [(g, h) for g, h, owner in zip(manifest["optimizer"]["param_groups"], source.hyperparameters(), owners)
                  if owner == k]
        states.append(_plain_optimizer_state(source, groups))
    return states


def _plain_optimizer_state(source: ShardedSource, saved_groups: list) -> dict:
    state, groups, param_id = {}, [], 0
    keys = source.state_keys()
    cpu = torch.device("cpu")
    for group, hyperparameters in saved_groups:
        ids = []
        for name in group["param_names"]:
            if source.has_state(name):
                shape = source.params[name]["shape"]
                entry = source.scalars(name, cpu)
                for key in keys:
                    values = source.read_state(name, Range(0, math.prod(shape)), key)
                    if values is not None:
                        entry[key] = values.view(shape)
                state[param_id] = entry
            ids.append(param_id)
            param_id += 1
        groups.append({**hyperparameters, "params": ids})
    return {"state": state, "param_groups": groups}
