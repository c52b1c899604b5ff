"""Resume after a crash: the newest complete, verified checkpoint in a directory.

A save publishes a checkpoint directory only when it is complete (save.py); an interrupted save leaves a hidden
``.<name>.tmp-<token>`` sibling without a manifest. This module needs no process group, so a job can choose
what to resume from before its engine exists; every rank reads the same files and reaches the same answer.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

from zero_core.checkpoint.format import MANIFEST, CheckpointError, PathLike, optimizer_classes, read_manifest
from zero_core.checkpoint.verify import verify_files


def latest_checkpoint(directory: PathLike, verify: str = "checksum") -> Optional[Path]:
    """The newest checkpoint directory under ``directory`` (by its manifest's write time) whose files all match
    its manifest; None if there is none. Leftovers of interrupted saves and damaged checkpoints are skipped,
    with a warning naming each. ``verify="size"`` only compares file sizes (faster, catches truncation)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    leftovers = sorted(p.name for p in directory.iterdir() if p.is_dir() and ".tmp-" in p.name)
    if leftovers:
        warnings.warn(f"skipping what interrupted saves left in '{directory}' (never complete checkpoints): "
                      f"{', '.join(leftovers)}", stacklevel=2)
    candidates = [p for p in directory.iterdir() if not p.name.startswith(".") and is_checkpoint(p)]
    candidates.sort(key=lambda p: ((p / MANIFEST).stat().st_mtime_ns, p.name), reverse=True)
    for candidate in candidates:
        problem = checkpoint_problem(candidate, verify)
        if problem is None:
            return candidate
        warnings.warn(f"skipping damaged checkpoint '{candidate}': {problem}", stacklevel=2)
    return None


def is_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory: it holds the manifest (``MANIFEST``, written last by a
    save). Cheap; :func:`checkpoint_problem` checks the files too."""
    path = Path(path)
    return path.is_dir() and (path / MANIFEST).is_file()


def has_optimizer_state(path: PathLike) -> bool:
    """Whether the checkpoint directory ``path`` holds optimizer state (not one saved weights only:
    ``save_optimizer_states=False``, or converted from weights alone)."""
    return bool(optimizer_classes(read_manifest(path)))


def checkpoint_problem(path: PathLike, verify: str = "checksum") -> Optional[str]:
    """Why the checkpoint directory ``path`` cannot be loaded (missing manifest, missing, truncated or damaged
    files), or None when it is complete and its files match the manifest. No process group needed."""
    try:
        manifest = read_manifest(path)
        verify_files(Path(path), manifest, sorted(manifest["files"]), checksum=verify == "checksum")
    except (CheckpointError, OSError, KeyError, ValueError) as error:
        return str(error)
    return None
