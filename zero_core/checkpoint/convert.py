"""``convert``: between our checkpoints and other libraries' formats, offline, one tensor at a time.

Ours -> theirs goes through ``WRITERS`` (format -> module and function called as
``fn(checkpoint_dir, out_dir, progress=...)``); theirs -> ours opens the foreign source that
``zero_core.checkpoint.foreign.detect`` finds and writes it as a world-size-1 checkpoint.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Literal

from zero_core.checkpoint.format import MANIFEST, CheckpointError, PathLike
from zero_core.checkpoint.foreign import detect
from zero_core.checkpoint.foreign.to_zero import write_zero_checkpoint

Target = Literal["dcp", "deepspeed", "zero"]

# ours -> theirs: format -> (module, function); a module missing from this build makes the format unavailable
WRITERS: dict[str, tuple[str, str]] = {
    "dcp": ("zero_core.checkpoint.foreign.dcp_writer", "write_dcp"),
    "deepspeed": ("zero_core.checkpoint.foreign.deepspeed_universal", "write_deepspeed_universal"),
}


def convert(src: PathLike, dst: PathLike, to: Target, progress: bool = True, **options) -> Path:
    """Convert checkpoint ``src`` to format ``to`` at ``dst`` (which appears only when complete).

    ``to="dcp"`` or ``"deepspeed"``: ``src`` is one of our checkpoints; ``options`` go to the writer (for DCP:
    ``layout="fsdp2"|"torchtitan"``, ``verify``; for DeepSpeed: ``verify``). ``to="zero"``: ``src`` is a foreign
    checkpoint (a DCP directory or a DeepSpeed one); ``options``: ``optimizer_class`` when it cannot be
    inferred."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"no checkpoint at '{src}'")
    ours = (src / MANIFEST).is_file()
    if to == "zero":
        if ours:
            raise CheckpointError(f"'{src}' is already one of our checkpoints (it has {MANIFEST})")
        return write_zero_checkpoint(src, dst, progress=progress, **options)
    if to not in WRITERS:
        raise ValueError(f"--to must be one of {sorted([*WRITERS, 'zero'])}, got {to!r}")
    if not ours:
        found = detect(src)
        what = f"a {found} checkpoint" if found else "not one of our checkpoints"
        raise CheckpointError(f"'{src}' is {what}: --to {to} converts our checkpoints (with {MANIFEST}); "
                              f"convert it with --to zero first")
    return writer(to)(src, dst, progress=progress, **options)


def writer(to: str):
    module_name, function = WRITERS[to]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise CheckpointError(f"--to {to} is not available in this version of lightning-zero ({module_name} "
                              "is not installed); convert to another format, or upgrade") from None
    return getattr(module, function)
