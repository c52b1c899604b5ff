"""Atomic sharded save: every rank writes its fragments, all agree, rank 0 writes the manifest and publishes.

Sequence (each arrow is a collective that every rank reaches, even after a local failure):
1. rank 0 picks a hidden temporary sibling directory and creates it  -> agree
2. every rank writes and fsyncs its shard file (rank 0 also the replicated and client state)  -> agree
3. the per-rank descriptions are gathered; rank 0 writes manifest.json last, fsyncs, and renames the directory
   into place (an atomic swap when replacing an earlier checkpoint)  -> agree
A rank that dies anywhere before 3 leaves only the hidden directory, which has no manifest and is never loaded.

With ``checkpoint.use_node_local_storage`` every node's first rank plays rank 0's part on its own disk (after a
check that the nodes do not share the directory): node_local.py.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

import torch

from zero_core.arg_checks import check_engine
from zero_core.contracts import CheckpointedEngine
from zero_core.checkpoint.collective import gather_json, on_first_replica, run_agreed, shared_token, staged_together
from zero_core.checkpoint.files import Pending, StagedDirectory, publish, write_safetensors
from zero_core.checkpoint.format import (
    EXCLUDED, FORMAT, FORMAT_VERSION, MANIFEST, MASTER_KIND, REPLICATED, CheckpointError, PathLike, dtype_name,
    shard_file, tensor_key, write_json,
)
from zero_core.checkpoint.model_info import iter_persistent_replicated, persistent_replicated_layout, tied_aliases
from zero_core.checkpoint.node_local import NODE_LOCAL, check_not_shared, leave_probe, node_place
from zero_core.checkpoint.values import encode_hyperparameters, encode_value, save_client_state
from zero_core.optim.weights_ema import EMA_KIND


def save_checkpoint(engine: CheckpointedEngine, path: PathLike, client_state: Optional[Any] = None,
                    exclude_frozen_parameters: bool = False, save_optimizer_states: bool = True) -> Path:
    """Save ``engine``'s model and optimizer state as a sharded checkpoint directory at ``path``. A collective.

    ``client_state`` (rank 0's is kept: loop counters, scheduler and RNG state...) is saved beside it and
    returned by :func:`load_checkpoint`. An earlier checkpoint at ``path`` is replaced only once the new one
    is complete; see docs/checkpoints.md. ``exclude_frozen_parameters`` (DeepSpeed's): the parameters the engine
    does not train (a LoRA run's base model) are left out, and named in the manifest so that a load keeps the
    model's own values for them. ``save_optimizer_states=False`` (Lightning's ``weights_only``): the fp32 master
    weights without the optimizer's state, a third of Adam's bytes; such a checkpoint loads weights only.
    """
    check_engine(engine, "zero_core.save_checkpoint")
    path = Path(path).absolute()
    if engine.config.checkpoint.use_node_local_storage and engine.topology.replicas > 1:
        raise CheckpointError(
            f"checkpoint.use_node_local_storage does not combine with zero_optimization.mics_shard_size "
            f"({engine.topology.world_size}): only the first replica writes, so other nodes would hold no files. "
            "Save to a shared file system with use_node_local_storage off")
    what = _Saved(bool(exclude_frozen_parameters), bool(save_optimizer_states))
    on_first_replica(engine, _save, engine, path, client_state, what)  # MiCS: replicas hold the same shards
    return path


class _Saved(NamedTuple):
    """What a save leaves out: the frozen parameters, the optimizer's state."""

    exclude_frozen: bool
    optimizer: bool


def _save(engine, path: Path, client_state: Optional[Any], what: _Saved) -> None:
    rank = engine.topology.rank
    place = node_place(engine) if engine.config.checkpoint.use_node_local_storage else None
    leader = rank == (place.first if place else 0)
    token = shared_token(engine)
    staged = StagedDirectory(path, token)
    if place is not None:
        run_agreed(engine, leave_probe, path, token, place, leader)
        run_agreed(engine, check_not_shared, path, token, place, leader)
    with staged_together(engine, staged, leader) as temp:
        report = run_agreed(engine, _write_rank, engine, temp, client_state, leader, what.optimizer)
        replicated = run_agreed(engine, _write_replicated, engine, temp, leader, what.exclude_frozen)  # gathers
        if replicated is not None:
            report["replicated"], report["files"][REPLICATED], report[EXCLUDED] = replicated
        reports = gather_json(engine, report)
        node = None if place is None else {"place": place, "save_id": token}
        run_agreed(engine, _finish, engine, reports, staged, leader, node, what.optimizer)


def _write_rank(engine, temp: Path, client_state: Any, leader: bool, optimizer: bool) -> dict:
    """Write this rank's shard file (and on rank 0 the client state); describe what was written."""
    name = shard_file(engine.topology.rank, engine.topology.world_size)
    entries, fragments, plan = _fragment_entries(engine, name, optimizer)
    with contextlib.closing(_fragment_tensors(engine, plan)) as data:
        info = write_safetensors(temp / name, entries, {"format": "pt"}, data)
    _add_crcs(fragments, info["crc32"])
    report = {"fragments": fragments, "files": {name: _file_entry(info)}}
    if leader and client_state is not None:
        report["files"].update(save_client_state(temp, client_state))
    return report


def _fragment_entries(engine, file: str, optimizer: bool = True) -> tuple[list, list, list]:
    """(key, Pending) entries to write, the manifest's description of each fragment, and the plan of
    :func:`_fragment_tensors`: (fragment, [(tensor key, optimizer state key or None for the master)]); without
    ``optimizer``, the masters (and their moving average) alone.

    Only shapes and dtypes are needed here, so nothing swapped out to NVMe is read (engine.shape_in_memory)."""
    entries, fragments, plan = [], [], []
    for fragment in engine.fragments():
        state = engine.optimizer_state_of(fragment.master) if optimizer else {}
        per_element, scalars = _split_state(state, fragment, engine)
        start, end = fragment.param_range.start, fragment.param_range.end
        tensors, keys = {}, []
        kinds = [(MASTER_KIND, None, fragment.master.dtype)] + [(k, k, d) for k, d in sorted(per_element.items())]
        if engine.weights_ema is not None:  # the moving average of the weights, beside the master it averages
            kinds.append((EMA_KIND, EMA_KIND, torch.float32))
        for kind, state_key, dtype in kinds:
            key = tensor_key(fragment.name, start, end, kind)
            in_memory = engine.shape_in_memory(fragment.master, None if kind == EMA_KIND else state_key)
            shape = torch.empty(in_memory, device="meta")[fragment.local.as_slice()].shape
            entries.append((key, Pending(dtype, tuple(shape))))
            tensors[kind] = {"key": key}
            keys.append((key, state_key))
        fragments.append({"name": fragment.name, "shape": list(fragment.shape), "dtype": dtype_name(fragment.dtype),
                          "file": file, "param_range": [start, end], "tensors": tensors, "scalars": scalars})
        plan.append((fragment, keys))
    return entries, fragments, plan


def _fragment_tensors(engine, plan: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor view) in the plan's order, each fragment's master and state in memory while it is written: with
    NVMe offload a few tiles at a time, read ahead and dropped once written (engine.offload_tiles); a piece bigger
    than a tile stays in the swap file and is written a slice at a time (engine.offload_in_file)."""
    keys_of = {id(fragment): keys for fragment, keys in plan}
    for tile in engine.offload_tiles([fragment for fragment, _ in plan]):
        for fragment in tile:
            in_file = engine.offload_in_file(fragment)
            if in_file is not None:  # (EMA does not combine with NVMe: every key is in the file)
                local = fragment.local
                for key, state_key in keys_of[id(fragment)]:
                    yield from ((key, values) for values in in_file.read(state_key, local.start, local.end))
                continue
            state = engine.optimizer_state_of(fragment.master)
            for key, state_key in keys_of[id(fragment)]:
                if state_key == EMA_KIND:
                    full = engine.weights_ema.average_of(fragment.master)
                else:
                    full = fragment.master if state_key is None else state[state_key]
                yield key, full.detach()[fragment.local.as_slice()]


def _split_state(state: dict, fragment, engine) -> tuple[dict, dict]:
    """A master's optimizer state: per-element tensors (the master's shape; key -> dtype) apart from JSON
    scalars. Shapes are those in memory, also of state swapped out to NVMe."""
    per_element, scalars = {}, {}
    master_shape = engine.shape_in_memory(fragment.master)
    for key, value in state.items():
        if torch.is_tensor(value) and engine.shape_in_memory(fragment.master, key) == master_shape:
            per_element[key] = value.dtype
            continue
        try:
            scalars[key] = encode_value(value)
        except TypeError as error:
            raise CheckpointError(
                f"optimizer state {key!r} of parameter '{fragment.name}' is neither per-element (the shape "
                f"{tuple(master_shape)} of its master shard) nor a scalar ({error}); this optimizer's "
                "state cannot be sharded") from None
    return per_element, scalars


def _add_crcs(fragments: list, crcs: dict) -> None:
    for fragment in fragments:
        for entry in fragment["tensors"].values():
            entry["crc32"] = crcs[entry["key"]]


def _file_entry(info: dict) -> dict:
    return {"bytes": info["bytes"], "sha256": info["sha256"]}


def _write_replicated(engine, temp: Path, leader: bool,
                      exclude_frozen: bool) -> Optional[tuple[list, dict, list]]:
    """The buffers and the parameters outside the optimizer into the replicated file (rank 0 writes it; in stage
    3 every rank takes part in gathering the frozen parameters). Streamed: a frozen unit is gathered, written and
    released before the next, so a model whose frozen base is most of it (LoRA) is never whole on a rank. With
    ``exclude_frozen`` those parameters are left out (nothing is gathered) and listed as the third item."""
    layout = persistent_replicated_layout(engine)
    items = iter_persistent_replicated(engine, buffers_only=exclude_frozen)
    buffers = {name for name, _ in engine.module.named_buffers()}
    excluded = [name for name in layout if exclude_frozen and name not in buffers]
    layout = {name: entry for name, entry in layout.items() if name not in excluded}
    try:
        if not leader:
            return None
        entries = [(name, Pending(dtype, tuple(shape))) for name, (shape, dtype) in layout.items()]
        info = write_safetensors(temp / REPLICATED, entries, {"format": "pt"}, items)
    finally:
        for _ in items:  # the gathers to the end on every rank, also after a failed write (the others wait in them)
            pass
    described = [{"name": name, "shape": list(shape), "dtype": dtype_name(dtype), "key": name,
                  "crc32": info["crc32"][name]} for name, (shape, dtype) in layout.items()]
    return described, _file_entry(info), excluded


def _finish(engine, reports: list, staged: StagedDirectory, leader: bool, node: Optional[dict],
            optimizer: bool) -> None:
    if not leader:
        return
    if node is None:
        manifest = build_manifest(engine, reports, optimizer=optimizer)
    else:  # this node's directory: every fragment, but only the files written here
        place = node["place"]
        manifest = build_manifest(engine, reports, here=place.ranks, optimizer=optimizer)
        manifest[NODE_LOCAL] = {"node": place.node, "nodes": place.nodes, "save_id": node["save_id"]}
    write_json(staged.temp / MANIFEST, manifest)
    # The moment the checkpoint appears (tests/checkpoint/test_checkpoint_crash.py kills here).
    publish(staged.temp, staged.path)


def build_manifest(engine, reports: list, here: Optional[tuple] = None, optimizer: bool = True) -> dict:
    """The manifest of the ranks' ``reports``; ``here``: only these ranks' files (the first wrote the
    replicated and client state), for a node-local directory. Without ``optimizer`` state saved, the optimizer
    names no class (what a load reads as weights alone) and keeps the groups' hyper-parameters."""
    here = range(len(reports)) if here is None else here
    files = {}
    for rank in here:
        files.update(reports[rank]["files"])
    groups = [group for inner in engine.inner_optimizers for group in inner.param_groups]
    classes = [f"{type(inner).__module__}.{type(inner).__qualname__}" for inner in engine.inner_optimizers]
    classes = classes if optimizer else []
    scaler, ema = engine.loss_scaler, engine.weights_ema
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "run": _run_info(engine),
        "files": files,
        "parameters": _parameters(engine, reports),
        "replicated": reports[here[0]]["replicated"],
        EXCLUDED: reports[here[0]][EXCLUDED],  # frozen parameters left out: a load keeps the model's values
        "aliases": tied_aliases(engine.module),
        "optimizer": {
            "class": classes[0] if classes else None,
            "classes": classes,  # one per optimizer; each group names its optimizer's index
            "per_element_keys": sorted({k for r in reports for f in r["fragments"] for k in f["tensors"]}
                                       - {MASTER_KIND, EMA_KIND}),
            "param_groups": [{"param_names": list(names), "optimizer": owner,
                              "hyperparameters": encode_hyperparameters(group, i)}
                             for i, (names, group, owner) in enumerate(zip(engine.group_param_names, groups,
                                                                           engine.group_optimizer))],
        },
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "skipped_steps": int(engine.skipped_steps),
        "weights_ema": None if ema is None else {"decay": ema.decay, "updates": ema.updates},
    }


def _parameters(engine, reports: list) -> list:
    """One entry per trainable parameter, in the optimizer's order, with its fragments sorted by range."""
    pieces = defaultdict(list)
    for report in reports:
        for fragment in report["fragments"]:
            pieces[fragment["name"]].append(fragment)
    group_of = {n: i for i, names in enumerate(engine.group_param_names) for n in names}
    ordered = [n for names in engine.group_param_names for n in names if n in pieces]
    ordered += sorted(set(pieces) - set(ordered))
    out = []
    for name in ordered:
        found = sorted(pieces[name], key=lambda f: f["param_range"][0])
        first = found[0]
        _check_coverage(name, first["shape"], [f["param_range"] for f in found])
        keep = ("file", "param_range", "tensors", "scalars")
        out.append({"name": name, "shape": first["shape"], "dtype": first["dtype"], "group": group_of.get(name),
                    "fragments": [{k: f[k] for k in keep} for f in found]})
    return out


def _check_coverage(name: str, shape: list, ranges: list) -> None:
    numel, cursor = 1, 0
    for dim in shape:
        numel *= dim
    for start, end in ranges:
        if start != cursor:
            break
        cursor = end
    if cursor != numel:
        raise CheckpointError(f"the engine's fragments of '{name}' do not cover it exactly once: {ranges} for "
                              f"{numel} elements (a bug in the engine's fragments(); please report it)")


def _run_info(engine) -> dict:
    try:
        library = importlib.metadata.version("lightning-zero")
    except importlib.metadata.PackageNotFoundError:
        library = "unknown (not installed)"
    import safetensors

    return {
        "stage": engine.config.stage,
        "world_size": engine.topology.world_size,
        "zero_config": json.loads(json.dumps(engine.config.to_dict(), default=str)),
        "versions": {"lightning-zero": library, "torch": torch.__version__, "safetensors": safetensors.__version__,
                     "python": platform.python_version()},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
