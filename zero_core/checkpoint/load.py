"""Verified, resharding load: each rank fills its own fragments from whatever world size and stage saved them.

Steps, each ending in an agreement so that every rank raises the same error or none does:
1. read the manifest; 2. check file sizes and SHA-256 (the files are split between the ranks); 3. compare the
checkpoint's parameter names and shapes with the model's; 4. read this rank's ranges into its fp32 masters and
optimizer state; 5. all-gather the parameters from the masters (``refresh_params_from_masters``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from zero_core.arg_checks import check_engine
from zero_core.contracts import CheckpointedEngine
from zero_core.checkpoint.collective import agree, gather_json, run_agreed
from zero_core.checkpoint import foreign
from zero_core.checkpoint.format import (
    CLIENT_STATE, EXCLUDED, MASTER_KIND, CheckpointMismatchError, PathLike, optimizer_classes, read_manifest,
)
from zero_core.checkpoint.model_info import persistent_replicated_layout, tied_aliases, trainable_shapes
from zero_core.checkpoint.node_local import NODE_LOCAL, check_loadable_here, files_to_verify, node_place
from zero_core.checkpoint.sources import HF_INDEX, FullStateSource, PlainOptimizerSource, ShardedSource
from zero_core.checkpoint.values import load_client_state
from zero_core.checkpoint.verify import verify_files
from zero_core.layout import Range
from zero_core.optim.weights_ema import EMA_KIND

Verify = Literal["checksum", "size"]


def load_checkpoint(engine: CheckpointedEngine, path: PathLike, strict: bool = True, load_optimizer_states: bool = True,
                    verify: Verify = "checksum") -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` (any world size, any stage) into ``engine``.

    Returns the ``client_state`` saved with it (None if there was none). A collective. ``path`` may also be a
    plain model state dict (``.safetensors``/``.pt`` file, or a consolidated directory): see
    :func:`load_full_state_dict`; or another library's checkpoint: a DCP directory from FSDP2 or torchtitan, or a
    DeepSpeed ZeRO checkpoint directory, whose client state (with DeepSpeed's ``lr_scheduler`` and
    ``global_steps``) is returned: see :func:`load_foreign` and docs/checkpoints.md ("Coming from DeepSpeed",
    "Coming from FSDP / torchtitan"). ``strict=False`` loads what matches and warns about missing and unexpected
    names; shape mismatches are always errors. ``verify="size"`` skips the SHA-256 pass over the files.
    """
    check_engine(engine, "zero_core.load_checkpoint")
    path = Path(path)
    if path.is_file() or (path / HF_INDEX).is_file():
        load_full_state_dict(engine, path, strict=strict)
        return None
    if run_agreed(engine, foreign.detect, path):
        return load_foreign(engine, path, strict, load_optimizer_states)
    manifest = run_agreed(engine, read_manifest, path)
    place = node_place(engine) if any(gather_json(engine, NODE_LOCAL in manifest)) else None
    if place is not None:
        run_agreed(engine, check_loadable_here, manifest, path, place, engine.topology.world_size)
    run_agreed(engine, _verify_my_share, engine, path, manifest, verify, place)
    with ShardedSource(path, manifest) as source:
        if load_optimizer_states:
            _add_saved_groups(engine, manifest, source)
        optimizer = source if load_optimizer_states and _optimizer_matches(engine, manifest, strict) else None
        _load(engine, source, optimizer, strict)
        if load_optimizer_states:
            run_agreed(engine, _load_scaler, engine, manifest)
    if CLIENT_STATE in manifest["files"]:
        return run_agreed(engine, load_client_state, path)
    return None


def load_full_state_dict(engine: CheckpointedEngine, model_state: Union[dict, PathLike],
                         optimizer_state: Optional[Union[dict, list, PathLike]] = None, strict: bool = True) -> None:
    """Load a plain model state dict (DDP or one process) and optionally a plain ``optimizer.state_dict()``.

    ``model_state`` is a dict, a ``.safetensors`` or torch file, or a directory of safetensors shards with
    ``model.safetensors.index.json`` (what ``consolidate`` writes). The optimizer state's integer ids map to
    parameters through ``engine.group_param_names``, as for the optimizer the state dict came from; with
    several optimizers give a list of their state dicts, in the engine's order. Each rank keeps only its own
    ranges. A collective.
    """
    check_engine(engine, "zero_core.load_full_state_dict")
    if optimizer_state is not None and not isinstance(optimizer_state, (dict, list)):
        optimizer_state = torch.load(optimizer_state, map_location="cpu", weights_only=True, mmap=True)
    source = run_agreed(engine, FullStateSource, model_state)
    with source:
        optimizer = None
        if optimizer_state is not None:
            optimizer = run_agreed(engine, PlainOptimizerSource, optimizer_state, engine.group_param_names)
        _load(engine, source, optimizer, strict)


def load_foreign(engine: CheckpointedEngine, path: PathLike, strict: bool = True,
                 load_optimizer_states: bool = True) -> Any:
    """Load another library's checkpoint (``zero_core.checkpoint.foreign``: DCP, DeepSpeed) through the same
    checks and resharding load as ours: weights; and, when it has them, the optimizer state and hyper-parameters,
    the loss scaler and skipped steps. Returns its client state (DeepSpeed: the caller's client_state with
    DeepSpeed's lr_scheduler and step counters; DCP: None). Every rank opens the source (which checks the files
    and entries) and finds every group's hyper-parameters before anything is loaded. A collective."""
    model_names = {n for n, _ in engine.module.named_parameters()} | {n for n, _ in engine.module.named_buffers()}
    groups = [list(names) for names in engine.group_param_names]
    with run_agreed(engine, foreign.open_source, Path(path), model_names, groups) as source:
        optimizer = None
        if load_optimizer_states and run_agreed(engine, source.has_optimizer):
            run_agreed(engine, source.hyperparameters)
            if _foreign_optimizer_matches(engine, source.state_keys(), path, strict):
                optimizer = source
        _load(engine, source, optimizer, strict)
        if optimizer is not None:
            run_agreed(engine, _load_scaler, engine, {"skipped_steps": source.skipped_steps(),
                                                      "loss_scaler": source.loss_scaler()})
        return source.client_state()


def _foreign_optimizer_matches(engine, keys: list[str], path: PathLike, strict: bool) -> bool:
    """A foreign checkpoint names no optimizer class; its per-element state must be what the engine's
    optimizers keep (Adam's exp_avg and exp_avg_sq for the Adam family)."""
    adam = {"exp_avg", "exp_avg_sq"}
    current = [type(inner) for inner in engine.inner_optimizers]
    if set(keys) != adam or all(issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)) for cls in current):
        return True
    names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in current)
    return _optimizer_mismatch(f"'{path}' holds Adam's optimizer state ({sorted(keys)}), the engine's optimizer "
                               f"is {names}", strict, stacklevel=5)


def _optimizer_mismatch(message: str, strict: bool, stacklevel: int) -> bool:
    """A checkpoint's optimizer state that the engine's optimizers cannot take: an error if strict, else a
    warning (``stacklevel`` counted from the caller) and the model alone loads."""
    if strict:
        raise CheckpointMismatchError(f"{message}; pass strict=False to load the model alone")
    warnings.warn(f"{message}: optimizer state not loaded", stacklevel=stacklevel)
    return False


def _add_saved_groups(engine, manifest: dict, source) -> None:
    """Groups the checkpoint has beyond the engine's, at the end of an optimizer's list, that hold model
    parameters in no group yet (added after setup, e.g. by Lightning's BackboneFinetuning) are added again."""
    saved = manifest["optimizer"]["param_groups"]
    owners = [group.get("optimizer", 0) for group in saved]
    params = dict(engine.module.named_parameters())
    taken = {name for names in engine.group_param_names for name in names}
    hyperparameters = source.hyperparameters()
    for k in range(len(engine.inner_optimizers)):
        have = engine.group_optimizer.count(k)
        mine = [i for i, owner in enumerate(owners) if owner == k]
        for index in mine[have:]:
            names = saved[index]["param_names"]
            if not names or any(n not in params or n in taken for n in names):
                return  # not a group added after setup: the group count check reports the mismatch
            values = {key: v for key, v in hyperparameters[index].items() if key not in ("params", "param_names")}
            engine.add_param_group(k, {**values, "params": [params[n] for n in names]})
            taken.update(names)


def _verify_my_share(engine, path: Path, manifest: dict, verify: Verify, place=None) -> None:
    """This rank checks every world_size-th file (of a node-local directory: of its node's ranks), so the files
    are read once in all."""
    rank, world = engine.topology.rank, engine.topology.world_size
    files = sorted(manifest["files"])[rank::world] if place is None else files_to_verify(manifest, place, rank)
    verify_files(path, manifest, files, checksum=verify == "checksum")


def _optimizer_matches(engine, manifest: dict, strict: bool) -> bool:
    saved = optimizer_classes(manifest)
    if not saved:  # weights alone (save_optimizer_states=False, or converted from weights without optimizer state)
        return False
    current = [f"{type(inner).__module__}.{type(inner).__qualname__}" for inner in engine.inner_optimizers]
    if saved == current:
        return True
    saved, current = ", ".join(saved), ", ".join(current)
    return _optimizer_mismatch(f"the checkpoint's optimizer state is from {saved}, the engine's optimizer is "
                               f"{current}", strict, stacklevel=4)


def _load(engine, source, optimizer, strict: bool) -> None:
    model_shapes = trainable_shapes(engine)
    replicated = persistent_replicated_layout(engine)  # names and whole shapes: nothing gathered
    model_shapes.update({n: list(shape) for n, (shape, _) in replicated.items()})
    for name in getattr(source, "manifest", {}).get(EXCLUDED, ()):  # saved with exclude_frozen_parameters
        if name in replicated:  # left out on purpose, and still frozen here: the model keeps its own values
            del model_shapes[name]
    run_agreed(engine, _match, source, model_shapes, tied_aliases(engine.module), strict)
    names = _source_names(source, engine.module)
    run_agreed(engine, _load_fragments, engine, source, optimizer, names, strict)
    _load_replicated(engine, source, [n for n in replicated if n in names], names)
    engine.refresh_params_from_masters()


def _match(source, model_shapes: dict, aliases: dict, strict: bool) -> None:
    """Names and shapes of checkpoint and model: shape differences always raise, missing/unexpected if strict."""
    saved = {aliases.get(n, n): s for n, s in source.shapes().items()}
    wrong = [f"'{n}': checkpoint {tuple(saved[n])}, model {tuple(s)}"
             for n, s in model_shapes.items() if n in saved and list(saved[n]) != list(s)]
    if wrong:
        raise CheckpointMismatchError("the checkpoint does not match the model: shape mismatch for "
                                      + "; ".join(wrong))
    missing = sorted(set(model_shapes) - set(saved))
    unexpected = sorted(set(saved) - set(model_shapes))
    if not (missing or unexpected):
        return
    message = f"missing from the checkpoint: {missing}; unexpected in the checkpoint: {unexpected}"
    if strict:
        raise CheckpointMismatchError(f"the checkpoint does not match the model: {message}. "
                                      "Pass strict=False to load the parameters that match")
    warnings.warn(f"non-strict checkpoint load: {message}", stacklevel=4)


def _load_fragments(engine, source, optimizer, names: dict, strict: bool) -> None:
    """Each fragment's master values, then (``optimizer``) its optimizer state, a few tiles at a time with NVMe
    offload: a tile is read in, filled, written back into the model's parameter shards and out to the swap file
    (engine.offload_tiles), so the state is never all in memory at once."""
    round_to_16bit = not engine.config.load_from_fp32_weights
    state_of = _optimizer_loader(engine, optimizer) if optimizer is not None else None
    ema, saved_ema = engine.weights_ema, getattr(source, "has_weights_ema", lambda: False)()
    for tile in engine.offload_tiles(engine.fragments(), write=True):
        for fragment in tile:
            in_file = engine.offload_in_file(fragment)
            if in_file is not None:  # a piece bigger than a tile: filled a slice at a time in the swap file
                _load_in_slices(in_file, fragment, source, names.get(fragment.name), round_to_16bit, state_of)
                continue
            if fragment.name in names:
                values = source.read(names[fragment.name], fragment.param_range, MASTER_KIND)
                if round_to_16bit:  # DeepSpeed's load_from_fp32_weights=False: start from the 16-bit model weights
                    values = values.to(fragment.dtype)
                fragment.master_values().copy_(values)
            if ema is not None:  # saved averages, or (none saved) averaging starts again from the loaded weights
                average = (source.read(names[fragment.name], fragment.param_range, EMA_KIND)
                           if saved_ema and fragment.name in names else None)
                ema.load(fragment.master, average, fragment.local.as_slice())
            if state_of is not None:
                state_of(fragment)
    if optimizer is not None:
        inners = engine.inner_optimizers
        _load_hyperparameters([g for inner in inners for g in inner.param_groups], optimizer.hyperparameters(),
                              strict)


def _load_in_slices(in_file, fragment, source, name: Optional[str], round_to_16bit: bool, state_of) -> None:
    """:func:`_load_fragments` for a master piece left in the NVMe swap file (engine.offload_in_file): its
    master values (also into the model) and then its optimizer state, a slice at a time. A fragment the source
    lacks keeps its values (a non-strict load)."""
    first = fragment.param_range.start - fragment.local.start  # piece index -> element of the parameter

    def fill(start: int, end: int, out: torch.Tensor) -> None:
        values = source.read(name, Range(first + start, first + end), MASTER_KIND)
        out.copy_(values.to(fragment.dtype) if round_to_16bit else values)

    if name is not None:
        in_file.write(None, fragment.local.start, fragment.local.end, fill)
    if state_of is not None:
        state_of(fragment, in_file)


def _load_replicated(engine, source, wanted: list[str], names: dict) -> None:
    """Buffers are copied in place; frozen parameters go through ``engine.refresh_param``, a collective in
    stage 3. So every rank walks the same list to the end, and a read error is raised only after the walk."""
    params, buffers = dict(engine.module.named_parameters()), dict(engine.module.named_buffers())
    error = None
    for name in wanted:
        target = params.get(name, buffers.get(name))
        try:
            value = source.read_whole(names[name])
        except Exception as caught:
            error = error or caught
            value = torch.zeros(list(source.shapes()[names[name]]))  # keeps the collectives in step
        if name in params:
            engine.refresh_param(target, value)
        else:
            with torch.no_grad():
                target.copy_(value.view(target.shape))
    agree(engine, error)


def _source_names(source, module) -> dict[str, str]:
    """Model name -> the name the source uses (a state dict may hold a tied weight under an alias only)."""
    names = {n: n for n in source.shapes()}
    for alias, canonical in tied_aliases(module).items():
        if canonical not in names and alias in names:
            names[canonical] = alias
    return names


def _optimizer_loader(engine, source):
    """Clear the optimizers' state (like Optimizer.load_state_dict: the checkpoint's state replaces the current
    one) and return what loads one fragment's state (its master in memory). Optimizer sources are keyed by the
    engine's own parameter names (the manifest's, group_param_names)."""
    inners = engine.inner_optimizers
    for inner in inners:
        inner.state.clear()
    owner_of = {id(m): (g, inner) for inner in inners for g in inner.param_groups for m in g["params"]}
    keys = source.state_keys()

    def load(fragment, in_file=None) -> None:
        """``in_file``: the master piece is left in the NVMe swap file (engine.offload_in_file), and so is the
        state made for it, written a slice at a time."""
        name = fragment.name
        if not source.has_state(name):
            return
        master = fragment.master
        group, inner = owner_of[id(master)]
        on_device = group.get("capturable") or group.get("fused")  # else scalars stay on the CPU, as in torch
        state = inner.state[master]
        if not state:
            state.update({key: torch.zeros_like(master.detach()) if in_file is None else in_file.claim(key)
                          for key in keys})
        state.update(source.scalars(name, master.device if on_device else torch.device("cpu")))
        local = fragment.local
        for key in keys:
            if in_file is None:
                values = source.read_state(name, fragment.param_range, key)
                if values is not None:
                    state[key][local.as_slice()] = values
                continue
            first = fragment.param_range.start - local.start

            def fill(start: int, end: int, out: torch.Tensor, key=key) -> None:
                values = source.read_state(name, Range(first + start, first + end), key)
                out.copy_(values) if values is not None else out.zero_()  # (zeros: as made above)

            in_file.write(key, local.start, local.end, fill)

    return load


def _load_hyperparameters(groups: list[dict], saved: list[dict], strict: bool) -> None:
    if len(saved) != len(groups):
        message = f"the checkpoint has {len(saved)} optimizer parameter groups, the optimizers {len(groups)}"
        if strict:
            raise CheckpointMismatchError(message)
        warnings.warn(f"{message}: hyper-parameters not loaded", stacklevel=5)
        return
    for group, values in zip(groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def _load_scaler(engine, manifest: dict) -> None:
    engine.restore_skipped_steps(int(manifest.get("skipped_steps", 0)))
    saved_ema = manifest.get("weights_ema")
    if engine.weights_ema is not None:
        engine.weights_ema.updates = int(saved_ema["updates"]) if saved_ema else 0
    if engine.loss_scaler is not None and manifest.get("loss_scaler"):
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
