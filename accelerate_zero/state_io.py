"""``save_state``/``load_state`` for ZeRO models, beside what Accelerate saves itself.

A ``save_state`` directory holds Accelerate's usual files (schedulers, samplers, RNG states, custom objects,
and any model that is not under ZeRO) plus, for the prepared model at position ``i`` of
``accelerator._models``, a sharded ``zero_core`` checkpoint directory ``zero_model`` (``zero_model_<i>`` for
``i > 0``) with that model's weights, fp32 master weights, optimizer state and fp16 loss scale, written
atomically by every rank. ``zero_state.json`` records which model and optimizer each directory belongs to.

``load_state`` also reads a directory written by plain Accelerate (DDP or one process): ``model.safetensors``
(or ``pytorch_model.bin``) and ``optimizer.bin`` go into the engine, each rank keeping its own shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from . import elastic

ZERO_STATE_FILE = "zero_state.json"


def zero_dir_name(model_index: int) -> str:
    return "zero_model" if model_index == 0 else f"zero_model_{model_index}"


def suffix(index: int) -> str:
    return "" if index == 0 else f"_{index}"


def _positions(accelerator) -> list[tuple[object, int, list[Optional[int]]]]:
    """(managed model, its index in accelerator._models, for each of its engine's optimizers the index of the
    prepared optimizer in accelerator._optimizers, None if it was not prepared)."""
    out = []
    for managed in accelerator._managed:
        model_index = next(i for i, m in enumerate(accelerator._models) if m is managed.module)
        opt_indices = []
        for k in range(len(managed.engine.optimizers)):
            opt = managed.optimizers.get(k)
            opt_indices.append(next((i for i, o in enumerate(accelerator._optimizers) if o is opt), None)
                               if opt is not None else None)
        out.append((managed, model_index, opt_indices))
    return out


def save_engines(accelerator, directory, global_batch: Optional[dict] = None,
                 exclude_frozen_parameters: bool = False) -> None:
    """Every rank: one sharded checkpoint per ZeRO model, then rank 0 writes ``zero_state.json`` (with
    ``checkpoint.use_node_local_storage``: each machine's first process, into its own directory).
    ``global_batch``: elastic.py's record, when the accumulation is not the Accelerator's (the HF Trainer's).
    ``exclude_frozen_parameters`` (DeepSpeed's save_checkpoint keyword): the models' untrained parameters are
    left out."""
    from zero_core import save_checkpoint

    directory = Path(directory)
    entries = []
    for managed, model_index, opt_indices in _positions(accelerator):
        name = zero_dir_name(model_index)
        save_checkpoint(managed.engine, directory / name, exclude_frozen_parameters=exclude_frozen_parameters)
        entries.append({"dir": name, "model_index": model_index, "optimizer_indices": opt_indices,
                        "stage": managed.engine.config.stage})
    # node-local checkpoints: every machine's directory is its own, so each machine's first process records it
    node_local = any(m.engine.config.checkpoint.use_node_local_storage for m in accelerator._managed)
    if accelerator.is_main_process or (node_local and accelerator.is_local_main_process):
        if global_batch is None:
            global_batch = elastic.batch_record(accelerator.num_processes, accelerator.gradient_accumulation_steps)
        record = {"models": entries, elastic.KEY: global_batch}
        (directory / ZERO_STATE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    accelerator.wait_for_everyone()


def load_engines(accelerator, directory) -> None:
    """Every rank: each ZeRO model from its sharded checkpoint, or from plain Accelerate files if there is none."""
    from zero_core import load_checkpoint

    directory = Path(directory)
    for managed, model_index, opt_indices in _positions(accelerator):
        sharded = directory / zero_dir_name(model_index)
        if sharded.is_dir():
            load_checkpoint(managed.engine, sharded, load_optimizer_states=managed.has_optimizer)
        else:
            _load_accelerate_files(managed, directory, model_index, opt_indices)


def _load_accelerate_files(managed, directory: Path, model_index: int, opt_indices: list[Optional[int]]) -> None:
    """A checkpoint written by plain Accelerate: full weights (``module.`` prefixes from DDP are stripped by
    the loader) and each optimizer's full ``state_dict()``; each rank keeps its own ranges."""
    import torch

    from zero_core import load_full_state_dict

    model_file = _model_file(directory, model_index)
    optimizer_state = None
    if managed.has_optimizer and all(i is not None for i in opt_indices):
        files = [directory / f"optimizer{suffix(i)}.bin" for i in opt_indices]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{directory} has model weights but no {', '.join(missing)}: it is not a complete save_state "
                "directory (a ZeRO save_state has a zero_model directory instead)"
            )
        optimizer_state = files[0] if len(files) == 1 else \
            [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    load_full_state_dict(managed.engine, model_file, optimizer_state=optimizer_state)


def _model_file(directory: Path, model_index: int) -> Path:
    candidates = [directory / f"model{suffix(model_index)}.safetensors",
                  directory / f"pytorch_model{suffix(model_index)}.bin"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"{directory} holds no state for prepared model {model_index}: expected a {zero_dir_name(model_index)}/ "
            f"directory (written by ZeroAccelerator.save_state) or {candidates[0].name} / {candidates[1].name} "
            "(written by plain Accelerate)"
        )
    return found


def saved_global_batch(directory) -> Optional[dict]:
    """What ``save_engines`` recorded of the global batch (elastic.py), None for a state without it."""
    record = Path(directory) / ZERO_STATE_FILE
    return json.loads(record.read_text()).get(elastic.KEY) if record.is_file() else None


def latest_state(checkpoints_dir) -> Optional[Path]:
    """The newest ``save_state`` directory in ``checkpoints_dir`` that is complete: ``zero_state.json`` (written
    last) is there and every ZeRO checkpoint it lists verifies. Others are skipped with a warning."""
    import warnings

    from zero_core import checkpoint_problem

    directory = Path(checkpoints_dir)
    if not directory.is_dir():
        return None
    candidates = sorted((p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")),
                        key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    for candidate in candidates:
        record = candidate / ZERO_STATE_FILE
        if not record.is_file():
            problem = f"no {ZERO_STATE_FILE} (its save did not finish)"
        else:
            problems = [checkpoint_problem(candidate / entry["dir"])
                        for entry in json.loads(record.read_text())["models"]]
            problem = next((p for p in problems if p is not None), None)
        if problem is None:
            return candidate
        warnings.warn(f"skipping incomplete or damaged state '{candidate}': {problem}", stacklevel=3)
    return None


def next_iteration(checkpoints_dir) -> int:
    """One past the highest ``checkpoint_<n>`` in ``checkpoints_dir``: where ``automatic_checkpoint_naming``
    saves next after a resume."""
    numbers = [int(p.name.rpartition("_")[2]) for p in Path(checkpoints_dir).glob("checkpoint_*")
               if p.name.rpartition("_")[2].isdigit()]
    return max(numbers, default=-1) + 1
