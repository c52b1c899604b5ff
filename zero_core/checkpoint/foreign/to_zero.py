"""Theirs to ours, offline: a foreign checkpoint (any format of zero_core.checkpoint.foreign: DCP, DeepSpeed)
written as one of our sharded checkpoints of world size 1, as if one rank had saved it, which then loads,
reshards and consolidates at any world size and stage like any other.

No process group. Streaming: the shard file's header is written from shapes alone, then one parameter's fp32
weights and optimizer state at a time (``write_safetensors``' pending entries), so at most one whole tensor is
in memory. Parameters are the names in the source's optimizer groups or with optimizer state; every other
tensor (buffers, frozen parameters) goes to ``replicated.safetensors``, as a save would put them. What else the
source keeps (client state, loss scaler, skipped steps, tied names: DeepSpeed's) goes where a save puts it.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

import safetensors
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

SHARD = shard_file(0, 1)
# The class a format's Adam state means when its groups do not say (no ``decoupled_weight_decay``): DeepSpeed's
# own Adam (FusedAdam, DeepSpeedCPUAdam) decouples weight decay by default.
ADAM_WITHOUT_FLAG = {"deepspeed": "torch.optim.adamw.AdamW"}


def write_zero_checkpoint(source_dir: PathLike, out_dir: PathLike, progress: bool = True,
                          optimizer_class: Optional[str] = None) -> Path:
    """Convert the foreign checkpoint at ``source_dir`` (whichever format ``foreign.detect`` recognises) into
    our format at ``out_dir``, which appears only when complete. No process group needed."""
    name = foreign.detect(source_dir)
    if name is None:
        raise CheckpointError(f"'{source_dir}' is not a checkpoint format convert reads: "
                              f"{foreign.KNOWN_FORMATS}, or one of ours (with {MANIFEST})")
    with foreign.open_source(source_dir) as source:
        return write_zero(source, name, source_dir, out_dir, optimizer_class=optimizer_class, progress=progress)


def write_zero(source, format_name: str, source_path: PathLike, out_dir: PathLike,
               optimizer_class: Optional[str] = None, progress: bool = True) -> Path:
    """Write ``source`` (opened by the caller) as our checkpoint at ``out_dir`` (appears only when complete).
    ``optimizer_class`` (``torch.optim.adamw.AdamW``) is recorded for the load's class check; None: inferred
    from the saved state and hyper-parameters."""
    out = Path(out_dir).absolute()
    group_names, hyperparameters = source.stored_groups() if source.has_optimizer() else ([], [])
    shapes = source.shapes()
    trainable = [n for names in group_names for n in names if n in shapes]
    trainable += [n for n in shapes if n not in trainable and source.has_state(n)]
    replicated = [n for n in shapes if n not in trainable]
    classes = [optimizer_class or infer_optimizer_class(source, hyperparameters, format_name)] if trainable else []
    with atomic_directory(out) as temp:
        files, parameters = _write_shard(source, trainable, temp, progress)
        group_of = {n: i for i, names in enumerate(group_names) for n in names}
        for parameter in parameters:
            parameter["group"] = group_of.get(parameter["name"])
        described, files[REPLICATED] = _write_replicated(source, replicated, temp)
        client = source.client_state()
        if client:
            files.update(save_client_state(temp, client))
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "run": _run_info(format_name, source_path, source.origin()), "files": files, "parameters": parameters,
            "replicated": described, "aliases": source.aliases(),
            "optimizer": {"class": classes[0] if classes else None, "classes": classes,
                          "per_element_keys": sorted(source.state_keys()) if trainable else [],
                          "param_groups": [{"param_names": list(names), "optimizer": 0,
                                            "hyperparameters": encode_hyperparameters(values, i)}
                                           for i, (names, values) in enumerate(zip(group_names, hyperparameters))]},
            "loss_scaler": source.loss_scaler(), "skipped_steps": source.skipped_steps(),
        }
        write_json(temp / MANIFEST, manifest)
    return out


def infer_optimizer_class(source, hyperparameters: list[dict], format_name: Optional[str] = None) -> str:
    """torch's class for the state a foreign checkpoint holds; the formats do not record it."""
    keys = set(source.state_keys())
    first = hyperparameters[0] if hyperparameters else {}
    decoupled = first.get("decoupled_weight_decay")  # torch's Adam and AdamW both keep it, True for AdamW
    if {"exp_avg", "exp_avg_sq"} <= keys and decoupled is not None:
        return "torch.optim.adamw.AdamW" if decoupled else "torch.optim.adam.Adam"
    if {"exp_avg", "exp_avg_sq"} <= keys and format_name in ADAM_WITHOUT_FLAG:
        return ADAM_WITHOUT_FLAG[format_name]
    if "momentum" in first and "dampening" in first:
        return "torch.optim.sgd.SGD"
    raise CheckpointError(f"cannot tell which optimizer wrote the state {sorted(keys)} with hyper-parameters "
                          f"{sorted(first)}: pass optimizer_class (e.g. --optimizer_class torch.optim.adamw.AdamW)")


def _write_shard(source, names: list[str], temp: Path, progress: bool) -> tuple[dict, list]:
    shapes, keys = source.shapes(), source.state_keys()
    entries, parameters, plan = [], [], []
    for name in names:
        numel = math.prod(shapes[name])
        kinds = [MASTER_KIND] + [k for k in keys if source.has_state(name)]
        tensors = {}
        for kind in kinds:
            key = tensor_key(name, 0, numel, kind)
            entries.append((key, Pending(torch.float32, (numel,))))
            tensors[kind] = {"key": key}
            plan.append((key, name, kind, numel))
        scalars = {k: encode_value(v) for k, v in source.scalars(name, torch.device("cpu")).items()} \
            if source.has_state(name) else {}
        parameters.append({"name": name, "shape": list(shapes[name]), "dtype": dtype_name(source.dtype(name)),
                           "group": None,
                           "fragments": [{"file": SHARD, "param_range": [0, numel], "tensors": tensors,
                                          "scalars": scalars}]})
    info = write_safetensors(temp / SHARD, entries, {"format": "pt"}, _tensors(source, plan, progress))
    for parameter in parameters:
        for entry in parameter["fragments"][0]["tensors"].values():
            entry["crc32"] = info["crc32"][entry["key"]]
    return {SHARD: {"bytes": info["bytes"], "sha256": info["sha256"]}}, parameters


def _tensors(source, plan: list, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    with tqdm(total=len(plan), desc="converting", unit="tensor", disable=not progress) as bar:
        for key, name, kind, numel in plan:
            values = source.read(name, Range(0, numel), kind).to(torch.float32).reshape(-1)
            bar.update(1)  # before the yield: the writer does not resume the stream after the last tensor
            yield key, values


def _write_replicated(source, names: list[str], temp: Path) -> tuple[list, dict]:
    shapes = source.shapes()
    state = [(n, Pending(source.dtype(n), tuple(shapes[n]))) for n in names]
    values = ((n, source.read_whole(n).to(p.dtype).contiguous()) for n, p in state)
    info = write_safetensors(temp / REPLICATED, state, {"format": "pt"}, values)
    described = [{"name": n, "shape": list(shapes[n]), "dtype": dtype_name(p.dtype), "key": n,
                  "crc32": info["crc32"][n]} for n, p in state]
    return described, {"bytes": info["bytes"], "sha256": info["sha256"]}


def _run_info(format_name: str, source_path: PathLike, origin: dict) -> dict:
    try:
        library = importlib.metadata.version("lightning-zero")
    except importlib.metadata.PackageNotFoundError:
        library = "unknown (not installed)"
    run = {"stage": origin.get("stage"), "world_size": 1,
           "converted_from": {"format": format_name, "path": str(source_path), **origin},
           "versions": {"lightning-zero": library, "torch": torch.__version__,
                        "safetensors": safetensors.__version__, "python": platform.python_version()},
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if run["stage"] is not None:  # the stage the foreign run trained at (DeepSpeed's)
        run["zero_config"] = {"zero_optimization": {"stage": run["stage"]}}
    return run
