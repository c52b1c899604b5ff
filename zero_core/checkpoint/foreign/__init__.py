"""Checkpoints written by other libraries, read as sources for the resharding load (``load.py``'s ``_load``).

``detect(path)`` returns the factory of the source that reads ``path``, or None. A factory is called as
``factory(path, model_names=None, group_param_names=None)`` (the engine's parameter and buffer names, and its
optimizer groups' parameter names, when an engine loads; None offline) and returns an object with
:class:`zero_core.checkpoint.sources.ShardedSource`'s protocol plus ``has_optimizer()`` and
``stored_groups()``. Add a format by adding a line to ``FORMATS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from zero_core.checkpoint.format import MANIFEST
from zero_core.checkpoint.foreign.dcp import DCPSource
from zero_core.checkpoint.foreign.dcp_files import is_dcp_directory

# (name, recognises a path, source factory), tried in order
FORMATS: list[tuple[str, Callable[[Path], bool], Callable]] = [
    ("dcp", is_dcp_directory, DCPSource),
]


def detect(path) -> Optional[tuple[str, Callable]]:
    """(format name, source factory) for a foreign checkpoint at ``path``; None for ours or anything else."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return None
    return next(((name, factory) for name, recognises, factory in FORMATS if recognises(path)), None)
