"""A foreign checkpoint written offline in our format, as if one rank had saved it: one shard file holding each
parameter whole (its fp32 master and optimizer state), the replicated state, the client state and a manifest.
It then loads, reshards and consolidates like any of ours. Tensors stream into the shard one at a time.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from zero_core.layout import Range
from zero_core.checkpoint import foreign
from zero_core.checkpoint.files import Pending, atomic_directory, write_safetensors
from zero_core.checkpoint.format import (
    FORMAT, FORMAT_VERSION, MANIFEST, MASTER_KIND, REPLICATED, CheckpointError, PathLike, dtype_name, shard_file,
    tensor_key, write_json,
)
from zero_core.checkpoint.values import encode_hyperparameters, encode_value, save_client_state


def write_zero_checkpoint(source_dir: PathLike, out_dir: PathLike, progress: bool = True) -> Path:
    """Convert the foreign checkpoint at ``source_dir`` (DeepSpeed) into our format at ``out_dir``, which appears
    only when complete. No process group needed."""
    out = Path(out_dir).absolute()
    with foreign.open_source(Path(source_dir)) as source, atomic_directory(out) as temp:
        keys = source.state_keys()
        file = shard_file(0, 1)
        names = [n for group in source.group_names() for n in group]
        entries = [(tensor_key(n, 0, _numel(source, n), kind), Pending(torch.float32, (_numel(source, n),)))
                   for n in names for kind in [MASTER_KIND, *keys]]
        stream = _tensors(source, names, keys, progress)
        info = write_safetensors(temp / file, entries, {"format": "pt"}, stream)
        files = {file: {"bytes": info["bytes"], "sha256": info["sha256"]}}
        replicated = _write_replicated(source, set(names), temp, files)
        client = source.client_state()
        if client:
            files.update(save_client_state(temp, client))
        manifest = _manifest(source, names, keys, file, info["crc32"], replicated, files)
        write_json(temp / MANIFEST, manifest)
    return out


def _numel(source, name: str) -> int:
    return math.prod(source.shapes()[name])


def _tensors(source, names: list[str], keys: list[str], progress: bool):
    for name in tqdm(names, desc="converting", disable=not progress):
        whole = Range(0, _numel(source, name))
        for kind in [MASTER_KIND, *keys]:
            value = source.read(name, whole) if kind == MASTER_KIND else source.read_state(name, whole, kind)
            if value is None:
                raise CheckpointError(f"the checkpoint has no optimizer state {kind!r} for '{name}'")
            yield tensor_key(name, 0, whole.end, kind), value.to(torch.float32)


def _write_replicated(source, trainable: set, temp: Path, files: dict) -> list:
    """Buffers and frozen parameters, whole."""
    state = {n: source.read_whole(n).contiguous() for n in source.shapes() if n not in trainable}
    info = write_safetensors(temp / REPLICATED, list(state.items()), {"format": "pt"})
    files[REPLICATED] = {"bytes": info["bytes"], "sha256": info["sha256"]}
    return [{"name": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype), "key": n, "crc32": info["crc32"][n]}
            for n, t in state.items()]


def _manifest(source, names: list[str], keys: list[str], file: str, crcs: dict, replicated: list,
              files: dict) -> dict:
    groups, hyper = source.group_names(), source.hyperparameters()
    if len(groups) != len(hyper):
        raise CheckpointError(f"the checkpoint lists {len(groups)} parameter groups but the optimizer state "
                              f"{len(hyper)}")
    group_of = {n: i for i, group in enumerate(groups) for n in group}
    parameters = []
    for name in names:
        numel = _numel(source, name)
        tensors = {kind: {"key": tensor_key(name, 0, numel, kind), "crc32": crcs[tensor_key(name, 0, numel, kind)]}
                   for kind in [MASTER_KIND, *keys]}
        scalars = {k: encode_value(v) for k, v in source.scalars(name, torch.device("cpu")).items()}
        parameters.append({"name": name, "shape": source.shapes()[name], "dtype": dtype_name(source.model_dtype(name)),
                           "group": group_of[name], "fragments": [{"file": file, "param_range": [0, numel],
                                                                   "tensors": tensors, "scalars": scalars}]})
    origin = source.origin()
    optimizer_class = _optimizer_class(hyper)
    zero_config = {"zero_optimization": {"stage": origin["stage"]}}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "run": {"stage": origin["stage"], "world_size": 1, "zero_config": zero_config,
                "versions": {"torch": torch.__version__}, "converted_from": origin,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        "files": files, "parameters": parameters, "replicated": replicated, "aliases": source.aliases(),
        "optimizer": {"class": optimizer_class, "classes": [optimizer_class], "per_element_keys": sorted(keys),
                      "param_groups": [{"param_names": group, "optimizer": 0,
                                        "hyperparameters": encode_hyperparameters(values, i)}
                                       for i, (group, values) in enumerate(zip(groups, hyper))]},
        "loss_scaler": source.loss_scaler(), "skipped_steps": source.skipped_steps(),
    }


def _optimizer_class(groups: list[dict]) -> str:
    """DeepSpeed records no optimizer class: torch's Adam and AdamW say which they are in
    ``decoupled_weight_decay``; DeepSpeed's own Adam (no such key) decouples weight decay by default."""
    decoupled = groups[0].get("decoupled_weight_decay", True) if groups else True
    return "torch.optim.adamw.AdamW" if decoupled else "torch.optim.adam.Adam"
