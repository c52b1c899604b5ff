"""Checkpoints written by other libraries, read as sources for the resharding load (``load.py``'s ``_load``).

    detect(path)        the name of the foreign format at ``path`` ("dcp", "deepspeed"), or None (ours, or none)
    open_source(path)   the source reading it: an object with the :class:`ForeignSource` protocol

Each format lives in its own modules (``dcp*.py``: FSDP2/torchtitan DCP directories; ``deepspeed*.py``:
DeepSpeed ZeRO directories); this file only dispatches. Add a format by adding a line to ``FORMATS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from zero_core.layout import Range
from zero_core.checkpoint.format import MANIFEST, MASTER_KIND, CheckpointError
from zero_core.checkpoint.foreign.dcp import DCPSource
from zero_core.checkpoint.foreign.dcp_files import is_dcp_directory
from zero_core.checkpoint.foreign.deepspeed import DeepSpeedSource, is_deepspeed_directory

# (name, recognises a path, source factory), tried in order. A factory is called as
# ``factory(path, model_names=None, group_param_names=None)``: the engine's parameter and buffer names, and its
# optimizer groups' parameter names, when an engine loads; None offline (convert).
FORMATS: list[tuple[str, Callable[[Path], bool], Callable[..., "ForeignSource"]]] = [
    ("dcp", is_dcp_directory, DCPSource),
    ("deepspeed", is_deepspeed_directory, DeepSpeedSource),
]

# For the error about a directory that is no checkpoint at all: what else would have been recognised.
KNOWN_FORMATS = ("a DCP directory from FSDP2 or torchtitan (with '.metadata'), or a DeepSpeed checkpoint (a "
                 "directory with 'latest', or a tag folder with *_model_states.pt)")


@runtime_checkable
class ForeignSource(Protocol):
    """What ``load.py``'s ``load_foreign`` and ``to_zero.py`` ask of every foreign source: the protocol of
    :class:`zero_core.checkpoint.sources.ShardedSource` (weights and optimizer state by element range), plus
    the rest of a run a format may or may not keep (trivial answers where it keeps none)."""

    def __enter__(self) -> "ForeignSource": ...

    def __exit__(self, *exc) -> None: ...

    # ShardedSource's protocol
    def shapes(self) -> dict[str, list[int]]: ...

    def read(self, name: str, rng: Range, kind: str = MASTER_KIND) -> torch.Tensor: ...

    def read_whole(self, name: str) -> torch.Tensor: ...

    def state_keys(self) -> list[str]: ...

    def has_state(self, name: str) -> bool: ...

    def read_state(self, name: str, rng: Range, key: str) -> Optional[torch.Tensor]: ...

    def scalars(self, name: str, device: torch.device) -> dict: ...

    def hyperparameters(self) -> list[dict]:
        """One dict per optimizer group of the engine (the stored groups' when opened without an engine)."""

    # the optimizer
    def has_optimizer(self) -> bool:
        """Whether there is optimizer state to load (False: weights alone)."""

    def stored_groups(self) -> tuple[list[list[str]], list[dict]]:
        """The checkpoint's own optimizer groups: each group's parameter names, and its hyper-parameters."""

    # the rest of the run
    def loss_scaler(self) -> Optional[dict]:
        """The dynamic fp16 loss scaler in our scaler's ``state_dict`` terms; None: none (DCP keeps none)."""

    def skipped_steps(self) -> int:
        """Steps the run skipped on overflow (0 where the format does not count them)."""

    def client_state(self) -> Any:
        """What ``load_checkpoint`` returns: the caller's own state saved with the run (None: none kept)."""

    # for an offline conversion to our format (to_zero.py)
    def dtype(self, name: str) -> torch.dtype:
        """The dtype the run kept ``name`` in (a parameter's trained dtype, a buffer's own)."""

    def aliases(self) -> dict[str, str]:
        """Tied names: alias -> the name the checkpoint stores."""

    def origin(self) -> dict:
        """What ``run.converted_from`` records besides format and path (e.g. DeepSpeed's stage and world size)."""


def detect(path) -> Optional[str]:
    """The name of the foreign format at ``path``; None for ours or anything else."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return None
    return next((name for name, recognises, _ in FORMATS if recognises(path)), None)


def open_source(path, model_names: Optional[set] = None,
                group_param_names: Optional[list[list[str]]] = None) -> ForeignSource:
    """The source reading the foreign checkpoint at ``path`` (it checks its files before anything is loaded)."""
    name = detect(path)
    if name is None:
        raise CheckpointError(f"'{path}' is not a foreign checkpoint this library reads ({KNOWN_FORMATS})")
    factory = next(factory for format_name, _, factory in FORMATS if format_name == name)
    return factory(Path(path), model_names=model_names, group_param_names=group_param_names)
