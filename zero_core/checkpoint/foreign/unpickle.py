"""Read another library's torch pickle without running code from it and without that library installed.

Two gates. First every global the pickle names is listed (``pickletools``, nothing is built) and anything
outside torch's own tensor machinery and the caller's stand-ins is refused, naming the file and the class.
Then the file is loaded by torch's ``weights_only`` unpickler, with each foreign class mapped to a plain
stand-in that only stores its attributes; storages are memory-mapped, so a later slice reads only its pages.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zero_core.checkpoint.format import CheckpointError

# What torch itself writes for tensors, sizes and ordered dicts (what weights_only allows by default).
_TORCH_GLOBALS = {
    "collections.OrderedDict", "torch.Size", "torch.Tensor", "torch.nn.parameter.Parameter",
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter", "torch._tensor._rebuild_from_type_v2",
    "torch._utils._rebuild_tensor_v3",
} | {f"torch.{kind}Storage" for kind in (
    "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "Untyped")} | {
    f"torch.{dtype}" for dtype in (  # e.g. the dtype DeepSpeed's fp16 loss scaler keeps
        "float16", "bfloat16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}


class StandIn:
    """A foreign object reduced to its attributes (``vars(obj)``); never runs the foreign class's code."""

    def __init__(self, *args: Any):
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({vars(self)})"


def load_restricted(path: Path, stand_ins: dict[str, Callable]) -> Any:
    """``torch.load`` of ``path`` allowing only torch's tensor globals and ``stand_ins`` (full name -> class)."""
    refused = sorted(set(pickle_globals(path)) - _TORCH_GLOBALS - set(stand_ins))
    if refused:
        raise CheckpointError(f"'{path}' names classes or functions this reader does not allow: {refused}. "
                              "Only tensors, containers and the known checkpoint classes are read; nothing from "
                              "the file is run")
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in stand_ins.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(f"cannot read '{path}' as a restricted torch pickle: {error}") from None


def pickle_globals(path: Path) -> Iterator[str]:
    """The ``module.name`` of every global the pickle inside a torch zip file refers to."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise CheckpointError(f"'{path}' is not a torch zip checkpoint (no single data.pkl inside)")
            data = archive.read(names[0])
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"cannot read '{path}' as a torch checkpoint: {error}") from None
    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL":
                yield arg.replace(" ", ".")
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                yield f"{strings[-2]}.{strings[-1]}"
            elif opcode.name == "STACK_GLOBAL":
                yield "<a global built from memoized strings>"
            if isinstance(arg, str):
                strings.append(arg)
    except Exception as error:
        raise CheckpointError(f"'{path}' holds a damaged pickle: {error}") from None
