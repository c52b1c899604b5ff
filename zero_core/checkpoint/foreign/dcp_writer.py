"""Hand back: one of our checkpoints as a DCP directory that ``dcp.load`` reads into an FSDP2 model and
optimizer (``get_state_dict``'s keys, so ``set_state_dict`` takes the result), without a process group.

Streaming: the state dict given to ``dcp.save`` holds meta tensors (shapes and dtypes for DCP's plan), and the
planner reads each tensor from our shard files only when torch's writer asks for it (``resolve_data``).
torch's ``FileSystemWriter`` keeps every tensor of a data file until that file is complete, so each tensor gets
a file of its own (``single_file_per_rank=False``): at most two whole tensors are in memory at a time, the one
being written and, until the next read returns, the one before (torch's loop variable still holds it).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Callable, Literal

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from tqdm.auto import tqdm

from zero_core.layout import Range
from zero_core.checkpoint.files import atomic_directory
from zero_core.checkpoint.format import CheckpointError, PathLike, optimizer_classes, read_manifest
from zero_core.checkpoint.foreign.dcp_files import METADATA
from zero_core.checkpoint.node_local import require_whole
from zero_core.checkpoint.sources import ShardedSource
from zero_core.checkpoint.verify import verify_files

Layout = Literal["fsdp2", "torchtitan"]


def write_dcp(checkpoint_dir: PathLike, out_dir: PathLike, layout: Layout = "fsdp2", verify: bool = True,
              progress: bool = True) -> Path:
    """Write checkpoint ``checkpoint_dir`` as a DCP directory ``out_dir`` (appears only when complete).

    ``layout="fsdp2"``: ``{"model": msd, "optim": osd}`` of ``get_state_dict(model, optimizer)`` (PyTorch's DCP
    recipe); ``"torchtitan"``: the model's keys at the top level and the optimizer flattened under
    ``optimizer.`` (``flatten_optimizer_state_dict=True``), as torchtitan's CheckpointManager loads them."""
    if layout not in ("fsdp2", "torchtitan"):
        raise ValueError(f"layout must be 'fsdp2' or 'torchtitan', got {layout!r}")
    path, out = Path(checkpoint_dir), Path(out_dir).absolute()
    manifest = read_manifest(path)
    require_whole(manifest, path)
    verify_files(path, manifest, sorted(manifest["files"]), checksum=verify)
    if len(optimizer_classes(manifest)) > 1:
        raise CheckpointError(f"'{path}' holds the state of {len(optimizer_classes(manifest))} optimizers; a DCP "
                              "state dict of get_state_dict holds one: convert a checkpoint of one optimizer")
    with ShardedSource(path, manifest) as source, atomic_directory(out, marker=METADATA) as temp:
        state, lazy = _state_dict(source, manifest, layout)
        _save(state, lazy, temp, progress)
    return out


def _state_dict(source: ShardedSource, manifest: dict, layout: Layout) -> tuple[dict, dict[str, Callable]]:
    """The nested state dict of meta tensors and values, and flattened DCP key -> reader of that tensor."""
    model_prefix, optimizer_key = ("model.", "optim") if layout == "fsdp2" else ("", "optimizer")
    lazy: dict[str, Callable] = {}
    model = {}
    names = [p["name"] for p in manifest["parameters"]] + [r["name"] for r in manifest["replicated"]]
    stored = {**{n: n for n in names}, **manifest["aliases"]}
    shapes = source.shapes()
    for name, canonical in stored.items():  # a tied weight under each of its names, as state_dict() has it
        model[name] = _meta(shapes[canonical], _model_dtype(manifest, canonical))
        lazy[model_prefix + name] = lambda n=canonical: source.read_whole(n)
    optimizer = _optimizer(source, manifest, layout, lazy, optimizer_key)
    state = {"model": model} if layout == "fsdp2" else dict(model)
    state[optimizer_key] = optimizer
    return state, lazy


def _model_dtype(manifest: dict, name: str) -> torch.dtype:
    """Trainable parameters as their fp32 masters; buffers and frozen parameters in their stored dtype."""
    replicated = {r["name"]: r["dtype"] for r in manifest["replicated"]}
    return getattr(torch, replicated[name]) if name in replicated else torch.float32


def _optimizer(source: ShardedSource, manifest: dict, layout: Layout, lazy: dict, top: str) -> dict:
    keys, cpu = source.state_keys(), torch.device("cpu")
    state: dict = {}
    for entry in manifest["parameters"]:
        name = entry["name"]
        if not source.has_state(name):
            continue
        values = dict(source.scalars(name, cpu))
        for key in keys:
            values[key] = _meta(entry["shape"], torch.float32)
            lazy[f"{top}.state.{name}.{key}"] = lambda n=name, k=key, s=entry["shape"]: \
                source.read_state(n, Range(0, math.prod(s)), k).view(s)
        state[name] = values
    groups = [(g["param_names"], h) for g, h in zip(manifest["optimizer"]["param_groups"], source.hyperparameters())]
    if layout == "fsdp2":
        return {"state": state, "param_groups": [{**h, "params": list(n)} for n, h in groups]}
    flat = {f"state.{name}.{key}": value for name, values in state.items() for key, value in values.items()}
    flat.update({f"param_groups.{name}.{hp}": value
                 for names, h in groups for name in names for hp, value in h.items()})
    return flat


def _meta(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(list(shape), dtype=dtype, device="meta")


def _save(state: dict, lazy: dict[str, Callable], out: Path, progress: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with tqdm(total=len(lazy), desc="writing DCP", unit="tensor", disable=not progress) as bar:
        writer = FileSystemWriter(str(out), single_file_per_rank=False, thread_count=1, sync_files=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer, planner=_ReadingPlanner(lazy, bar), no_dist=True)
    missing = sorted(set(lazy) - _written(out))
    if missing:
        raise CheckpointError(f"the DCP directory lacks {missing[:5]} after the save (a bug; please report it)")


def _written(out: Path) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(out)).read_metadata().state_dict_metadata)


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's default plan over the meta tensors; each tensor's data is read when torch's writer resolves it."""

    def __init__(self, lazy: dict[str, Callable], bar):
        super().__init__()
        self.lazy, self.bar = lazy, bar

    def resolve_data(self, write_item):
        read = self.lazy.get(write_item.index.fqn)
        if read is None:  # a bytes entry or a small real tensor (Adam's step)
            return super().resolve_data(write_item)
        tensor = read()
        self.bar.update(1)
        return tensor
