"""Lightning checkpoints <-> the core's sharded checkpoints (``zero_core.checkpoint``).

A Lightning checkpoint is a dict: the model (``state_dict``), the optimizers (``optimizer_states``) and
everything else (loops, callbacks, schedulers, hyper-parameters). The engine saves the first two itself, sharded
and resumable at any world size; the rest rides along as the checkpoint's ``client_state``. Loading returns that
rest, so Lightning restores loops, callbacks and schedulers as usual.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import zero_core
from zero_core import MANIFEST_FILE as MANIFEST

ENGINE_KEYS = ("state_dict", "optimizer_states")


def is_sharded_checkpoint(path: Path) -> bool:
    return zero_core.is_checkpoint(path)


def missing_checkpoint_error(path: Path) -> FileNotFoundError:
    if path.is_dir():
        return FileNotFoundError(
            f"'{path}' is a directory but not a ZeRO checkpoint (it has no {MANIFEST}); give a directory written "
            "by Trainer.save_checkpoint / ModelCheckpoint under ZeroStrategy, or a single-file checkpoint"
        )
    return FileNotFoundError(
        f"no checkpoint at '{path}': ZeroStrategy loads a sharded checkpoint directory or a single-file "
        "checkpoint (e.g. one written by DDP or by `python -m lightning_zero.convert`)"
    )


# Lightning's WeightAveraging saves its average as the checkpoint's "state_dict" and moves the model's own to
# "current_model_state" (stages 1-2; refused at stage 3). The engine saves the model's weights itself: the average
# rides along under its own key, and loading puts both back where the callback reads them.
AVERAGED_KEY = "weight_averaging_state_dict"
CURRENT_KEY = "current_model_state"


def newest_checkpoint(resume: str, checkpoint_callback) -> Optional[Path]:
    """``ZeroStrategy(resume=...)``: the newest complete, verified checkpoint in the directory ``resume`` names
    ("latest": the ModelCheckpoint's ``dirpath``); None when there is none yet (a first run)."""
    if resume == "latest":
        directory = getattr(checkpoint_callback, "dirpath", None)
        if directory is None:
            raise ValueError("ZeroStrategy(resume='latest') looks in the ModelCheckpoint's dirpath, but this Trainer "
                             "has no ModelCheckpoint with a directory; pass resume='<directory>' instead")
    else:
        directory = resume
    return zero_core.latest_checkpoint(directory)


def client_state_of(checkpoint: dict) -> dict:
    """Everything the engine does not save itself."""
    rest = {k: v for k, v in checkpoint.items() if k not in ENGINE_KEYS}
    if CURRENT_KEY in rest and "state_dict" in checkpoint:
        rest[AVERAGED_KEY] = checkpoint["state_dict"]
        del rest[CURRENT_KEY]
    return rest


def restore_averaged(client_state: dict, module) -> dict:
    """The keys WeightAveraging's ``on_load_checkpoint`` reads: its average, and the model's weights, which the
    engine has loaded already (whole on every rank at stages 1-2)."""
    if AVERAGED_KEY in client_state:
        client_state["state_dict"] = client_state.pop(AVERAGED_KEY)
        client_state[CURRENT_KEY] = module.state_dict()
    return client_state


def save_sharded(engine, checkpoint: dict, path: Path, exclude_frozen_parameters: bool = False,
                 optimizer: bool = True) -> None:
    """Every rank calls; the directory appears at ``path`` when complete. Without ``optimizer`` (Lightning's
    ``weights_only``, ``ModelCheckpoint(save_weights_only=True)``; a Fabric state without the optimizer) the
    weights alone."""
    zero_core.save_checkpoint(engine, path, client_state=client_state_of(checkpoint),
                              exclude_frozen_parameters=exclude_frozen_parameters, save_optimizer_states=optimizer)


def load_sharded(engine, path: Path, load_optimizer: bool, strict: bool) -> dict:
    """Weights (and optimizer state when ``load_optimizer``) into the engine; returns the Lightning rest."""
    client_state = zero_core.load_checkpoint(engine, path, strict=strict, load_optimizer_states=load_optimizer)
    if not isinstance(client_state, dict):
        raise RuntimeError(
            f"'{path}' is a ZeRO checkpoint without Lightning's state (it was not written by a Lightning "
            "Trainer); load it with zero_core.checkpoint.load_checkpoint or convert it first"
        )
    return restore_averaged(client_state, engine.module)


def load_full(engine, checkpoint: dict, optimizer_count: Optional[int], strict: bool) -> dict:
    """A single-file Lightning checkpoint (DDP's, or a converted one) into the engine.

    ``optimizer_count`` is the number of optimizers to restore (None: weights only).
    """
    if "state_dict" not in checkpoint:
        raise KeyError("the checkpoint has no 'state_dict': it is not a Lightning checkpoint")
    optimizer_state = _optimizer_states(checkpoint, optimizer_count)
    zero_core.load_full_state_dict(engine, checkpoint["state_dict"], optimizer_state=optimizer_state,
                                         strict=strict)
    return client_state_of(checkpoint)


def _optimizer_states(checkpoint: dict, optimizer_count: Optional[int]) -> Optional[list]:
    if optimizer_count is None:
        return None
    states = checkpoint.get("optimizer_states")
    if not states:
        warnings.warn(
            "the single-file checkpoint holds no optimizer state, so only the weights are restored; the optimizer "
            "starts fresh (resume from the sharded checkpoint directory to restore it)",
            stacklevel=3,
        )
        return None
    if len(states) != optimizer_count:
        raise RuntimeError(
            f"You have configured {optimizer_count} optimizers but the checkpoint contains {len(states)} optimizers "
            "to load. Please resume training with the same number of optimizers or edit the checkpoint manually "
            "to remove states."
        )
    return list(states)


def restore_into(state: dict, client_state: dict, keys) -> dict:
    """Fabric's contract: objects in ``state`` get their saved values in place; the rest is returned."""
    for key in keys:
        target, value = state[key], client_state.pop(key)
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        else:
            state[key] = value
    return client_state

