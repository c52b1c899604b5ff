"""Checkpoints written by other libraries, read as sources for the resharding loader (load.py's ``_load``).

    detect(path)        the name of the foreign format at ``path`` ("deepspeed"), or None
    open_source(path)   a source object (the ShardedSource protocol) for that checkpoint

Each format lives in its own module; this file only dispatches, so adding a format is one entry in each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from zero_core.checkpoint.format import CheckpointError

# For the error about a directory that is no checkpoint at all: what else would have been recognised.
KNOWN_FORMATS = "a DeepSpeed checkpoint (a directory with 'latest', or a tag folder with *_model_states.pt)"


def detect(path: Path) -> Optional[str]:
    from zero_core.checkpoint.foreign.deepspeed import tag_folder

    path = Path(path)
    if path.is_dir() and tag_folder(path) is not None:
        return "deepspeed"
    return None


def open_source(path: Path):
    kind = detect(path)
    if kind == "deepspeed":
        from zero_core.checkpoint.foreign.deepspeed import DeepSpeedSource

        return DeepSpeedSource(Path(path))
    raise CheckpointError(f"'{path}' is not a foreign checkpoint this library reads ({KNOWN_FORMATS})")
