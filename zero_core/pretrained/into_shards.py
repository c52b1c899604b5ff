"""Pretrained weights into a model whose parameters are partitioned, on the meta device, or whole.

``load_pretrained(model, path)`` is the one entry point; ``from_pretrained`` under ``zero_core.Init`` reaches the
same :func:`fill` (transformers_hook.py). What each parameter becomes:

- partitioned by ``zero_core.Init``: this rank reads only its own elements into its shard (no collective);
- on the meta device: a partitioned parameter is made from this rank's elements alone (``Init.adopt_shard``),
  so a model built on the meta device is never whole on any rank;
- under an engine (after ``setup``): ``load_full_state_dict``, which fills each rank's master fragments;
- an ordinary tensor (a buffer, a model not partitioned): read whole and copied in.

So while loading a rank holds its 1/N of the model plus at most one tensor's rows (files.py: where it can, a
rank's shard is a copy-on-write view of the file's pages, so loading copies nothing). ``rank0_reads`` instead
has rank 0 read every rank's shards and scatter them, a bucket at a time (rank0_reads.py): for file systems
where N readers are slow.
Every check (names, shapes) runs before the first value is written: a load that fails changes nothing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from zero_core import registry
from zero_core.checkpoint.format import CheckpointMismatchError
from zero_core.checkpoint.full_state import state_dict_entries
from zero_core.pretrained.files import SAFETENSORS_INDEX, PathLike, WeightFiles, resolve_weight_files
from zero_core.pretrained.rank0_reads import Rank0Reader, ShardToFill, scatter_shards
from zero_core.stage3.init_context import Init

DDP_PREFIX = "module."


class LoadResult(NamedTuple):
    """What ``torch.nn.Module.load_state_dict`` reports: model keys the files lack, file keys the model lacks."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class Target:
    """One model tensor (a parameter tied under several names counts once) and the file tensor that fills it."""

    keys: list[str]  # every model key naming this tensor (tied weights have several)
    file_key: str
    tensor: torch.Tensor
    is_param: bool


DtypeOf = Callable[[str, torch.Tensor], torch.dtype]


def load_pretrained(model: nn.Module, path: Union[PathLike, Sequence[PathLike]], *, strict: bool = True,
                    dtype: Optional[torch.dtype] = None, rank0_reads: Optional[bool] = None,
                    config=None) -> LoadResult:
    """Load a pretrained model's weights (``save_pretrained``'s directory, an index, ``.safetensors``/``.bin``
    files) into ``model``, each rank reading only what it keeps.

    ``model`` may be built under ``zero_core.Init``, on the meta device (it comes out partitioned, under a new
    ``Init(config=config)``), under an engine, or plain. ``dtype`` casts floating tensors that are still on the
    meta device (default: the dtype each was built with). ``rank0_reads`` (default: the Init's setting) has rank 0
    read and broadcast instead. ``strict`` as in ``load_state_dict``: missing or unexpected names are an error
    (else a warning); a shape that differs is always an error. A collective when parameters are partitioned.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_pretrained's first argument is the model (an nn.Module); it got a "
                        f"{type(model).__name__}. Call zero_core.load_pretrained(model, path)")
    engine = registry.engine_of(model)
    if engine is not None:
        from zero_core.checkpoint.load import load_full_state_dict

        load_full_state_dict(engine, _one_source(path), strict=strict)
        return LoadResult([], [])
    with WeightFiles.open(path) as files:
        targets, missing, unexpected = plan(model, files)
        _check(targets, files, missing, unexpected, strict)
        init = _partition_of(model)
        if init is None and any(t.tensor.is_meta for t in targets):
            with Init(config=config if config is not None else {"stage": 3}) as init:
                fill(model, targets, files, init, _dtype_of(dtype), bool(rank0_reads))
        else:
            reads = rank0_reads if rank0_reads is not None else (init is not None and init.rank0_reads)
            fill(model, targets, files, init, _dtype_of(dtype), bool(reads))
    return LoadResult(missing, unexpected)


def _one_source(path) -> Path:
    """What load_full_state_dict reads: one weight file, or a directory of safetensors shards with an index."""
    files = resolve_weight_files(path)
    if len(files) == 1:
        return files[0]
    if all(f.suffix == ".safetensors" for f in files) and (files[0].parent / SAFETENSORS_INDEX).is_file():
        return files[0].parent
    raise ValueError(f"a model under an engine loads one weight file or a safetensors index; '{path}' names "
                     f"{len(files)} files: consolidate them first (zero-checkpoint convert) or load before setup")


def plan(model: nn.Module, files: WeightFiles,
         file_key_of: Optional[Callable[[str], str]] = None) -> tuple[list[Target], list[str], list[str]]:
    """Which file tensor fills which model tensor: (targets, missing model keys, unexpected file keys).
    ``file_key_of`` maps a file key to the model's name for it (default: drop DDP's ``module.`` prefix)."""
    rename = file_key_of or (lambda key: key[len(DDP_PREFIX):] if key.startswith(DDP_PREFIX) else key)
    by_model_key = {rename(key): key for key in files.info}
    by_tensor: dict[int, Target] = {}
    for key, tensor in state_dict_entries(model):
        target = by_tensor.get(id(tensor))
        if target is None:
            target = by_tensor[id(tensor)] = Target([], "", tensor, isinstance(tensor, nn.Parameter))
        target.keys.append(key)
        if not target.file_key and key in by_model_key:
            target.file_key = by_model_key[key]
    targets = [t for t in by_tensor.values() if t.file_key]
    used = {t.file_key for t in targets}
    missing = [k for t in by_tensor.values() if not t.file_key for k in t.keys]
    unexpected = sorted(k for k in files.info if k not in used and rename(k) not in
                        {key for t in targets for key in t.keys})
    return targets, missing, unexpected


def shape_mismatches(targets: list[Target], files: WeightFiles) -> list[str]:
    return [f"'{t.keys[0]}': file {tuple(files.info[t.file_key].shape)}, model {tuple(t.tensor.shape)}"
            for t in targets if tuple(files.info[t.file_key].shape) != tuple(t.tensor.shape)]


def _check(targets: list[Target], files: WeightFiles, missing: list[str], unexpected: list[str], strict: bool) -> None:
    wrong = shape_mismatches(targets, files)
    if wrong:
        raise CheckpointMismatchError("the pretrained weights do not match the model: shape mismatch for "
                                      + "; ".join(wrong))
    if not (missing or unexpected):
        return
    message = f"missing from the weight files: {missing}; unexpected in the weight files: {unexpected}"
    if strict:
        raise CheckpointMismatchError(f"the pretrained weights do not match the model: {message}. Pass "
                                      "strict=False to load the tensors that match")
    warnings.warn(f"non-strict load of pretrained weights: {message}", stacklevel=3)


def _partition_of(model: nn.Module) -> Optional[Init]:
    for param in model.parameters():
        owner = registry.pending_partition_of(param)
        if isinstance(owner, Init):
            return owner
    return None


def _dtype_of(dtype: Optional[torch.dtype]) -> DtypeOf:
    return lambda key, tensor: dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _device() -> torch.device:
    device = torch.get_default_device()
    return torch.device("cpu") if device.type == "meta" else device


def fill(model: nn.Module, targets: list[Target], files: WeightFiles, init: Optional[Init], dtype_of: DtypeOf,
         rank0_reads: bool, after_set: Callable[[torch.Tensor], None] = lambda tensor: None) -> None:
    """Write every target; each rank of ``init`` walks the same list. No collective, unless ``rank0_reads``
    (rank0_reads.py: a scatter per bucket of shards, a broadcast per tensor kept whole). ``after_set`` sees each
    new tensor (the transformers hook marks it initialised)."""
    rank0 = init is not None and rank0_reads and init.comm.topology.world_size > 1
    sharded: list[tuple[Target, ShardToFill]] = []
    for target in targets:
        tensor = target.tensor
        if target.is_param and registry.pending_partition_of(tensor) is init and init is not None \
                and not tensor.is_meta:
            size = init.shard_range(tensor.numel())[1]
            sharded.append((target, ShardToFill(target.file_key, tensor.numel(), size, tensor.dtype,
                                                init.shard_of(tensor))))  # written in place
        elif target.is_param and tensor.is_meta:
            if init is None:
                raise RuntimeError(f"parameter '{target.keys[0]}' is on the meta device: load it under "
                                   "zero_core.Init, or pass config= to load_pretrained")
            size = init.shard_range(tensor.numel())[1]
            sharded.append((target, ShardToFill(target.file_key, tensor.numel(), size,
                                                dtype_of(target.keys[0], tensor))))
        else:
            _fill_whole(model, target, Rank0Reader(files, init.comm, _device()) if rank0 else files, dtype_of,
                        after_set)
    if rank0:
        scatter_shards([item for _, item in sharded], files, init.comm, _device())
    else:
        for _, item in sharded:
            mine = init.shard_range(item.numel)[0]
            if item.shard is not None:
                files.read_into(item.file_key, mine, item.shard[: mine.size])
            else:  # where it can, a view of the file's pages (files.py)
                item.shard = files.shard(item.file_key, mine, item.size, item.dtype, _device())
    for target, item in sharded:
        _adopt(model, target, item.shard, init, after_set)


def _adopt(model: nn.Module, target: Target, shard: torch.Tensor, init: Init,
           after_set: Callable[[torch.Tensor], None]) -> None:
    tensor = target.tensor
    if not tensor.is_meta:  # its partition's own shard was written in place
        after_set(tensor)
        return
    new = init.adopt_shard(tensor.shape, shard, tensor.requires_grad, target.keys[0])
    _set_everywhere(model, target.keys, new)
    after_set(new)


def _fill_whole(model: nn.Module, target: Target, reader, dtype_of: DtypeOf,
                after_set: Callable[[torch.Tensor], None]) -> None:
    """A tensor every rank keeps whole: a buffer, or a parameter that is not partitioned."""
    tensor = target.tensor
    value = reader.read_whole(target.file_key)
    if tensor.is_meta:
        new = value.to(dtype=dtype_of(target.keys[0], tensor), device=_device())
        _set_everywhere(model, target.keys, nn.Parameter(new, tensor.requires_grad) if target.is_param else new)
        after_set(new)
    else:
        with torch.no_grad():
            tensor.copy_(value)
        after_set(tensor)


def _set_everywhere(model: nn.Module, keys: list[str], value: torch.Tensor) -> None:
    for key in keys:
        module_name, _, attr = key.rpartition(".")
        setattr(model.get_submodule(module_name), attr, value)
