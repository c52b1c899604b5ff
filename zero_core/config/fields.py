"""Field machinery shared by the ZeroConfig dataclasses: documented fields, type and range checks,
and the checked ``__init__`` that translates DeepSpeed key names before the generated one runs."""

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import MISSING, field, fields
from typing import Any, ClassVar, Union

from zero_core.config.errors import ZeroConfigError, check_keys, type_error


def setting(default=MISSING, *, doc: str, factory=MISSING, minimum=None, above=None, choices=None,
            check=None, rule: str = ""):
    """A dataclass field with its documentation and constraint (`rule` describes a custom `check`)."""
    meta = {"doc": doc, "minimum": minimum, "above": above, "choices": choices, "check": check, "rule": rule}
    return field(default=default, default_factory=factory, metadata=meta)


def documented(cls):
    """Append a Google-style "Args:" section built from the field docs.

    jsonargparse (through docstring-parser) reads it for --help; attribute docstrings would need a
    global jsonargparse setting, which a library should not flip.
    """
    lines = [f"    {f.name}: {f.metadata['doc']}" for f in fields(cls)]
    cls.__doc__ = f"{cls.__doc__.strip()}\n\nArgs:\n" + "\n".join(lines) + "\n"
    return cls


def checked_init(cls):
    """Wrap the generated __init__ so keyword names are checked (and translated) before it runs."""
    generated = cls.__init__
    names = tuple(f.name for f in fields(cls) if f.init)

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        kwargs, autos = cls._prepare_kwargs(kwargs)
        generated(self, *args, **kwargs)
        self._record_given((*names[: len(args)], *kwargs), autos)

    cls.__init__ = __init__
    return cls


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


# ----------------------------------------------------------------------------- value checks


def _optional_inner(tp):
    """(inner type, True) for Optional[X], else (tp, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(path: str, value: Any, tp) -> Any:
    """Return `value` in its canonical type (5e8 -> 500000000) or raise naming `path`."""
    base, optional = _optional_inner(tp)
    if value is None and optional:
        return None
    if typing.get_origin(base) is list:  # list[str]; one string stands for a list of one, as in DeepSpeed
        items = [value] if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items):
            return list(items)
        raise type_error(path, "a list of strings", value)
    if base is bool and isinstance(value, bool):
        return value
    if base is int and not isinstance(value, bool):
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            return int(value)
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    expected = _TYPE_WORDS[base]
    if optional:
        expected = "true, false or null" if base is bool else f"{expected} or null"
    raise type_error(path, expected, value)


def type_text(cls, f: dataclasses.Field) -> str:
    """'int', 'bool or null', 'mapping', ... for the docs tables."""
    base, optional = _optional_inner(_hints(cls)[f.name])
    word = {bool: "bool", int: "int", float: "float", str: "string"}.get(base, "mapping")
    if typing.get_origin(base) is list:
        word = "list of strings"
    return word + (" or null" if optional else "")


def rule_text(meta: Mapping) -> str:
    if meta["rule"]:
        return meta["rule"]
    if meta["choices"] is not None:
        return "one of " + ", ".join(repr(c) for c in meta["choices"])
    if meta["minimum"] is not None:
        return f">= {meta['minimum']}"
    if meta["above"] is not None:
        return f"> {meta['above']}"
    return ""


def _violates(value: Any, meta: Mapping) -> bool:
    if meta["choices"] is not None and value not in meta["choices"]:
        return True
    if meta["minimum"] is not None and not value >= meta["minimum"]:
        return True
    if meta["above"] is not None and not value > meta["above"]:
        return True
    return meta["check"] is not None and not meta["check"](value)


def _check_value(path: str, value: Any, tp, meta: Mapping) -> Any:
    value = _check_type(path, value, tp)
    if value is not None and _violates(value, meta):
        raise ZeroConfigError(f"{path} must be {rule_text(meta)}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- blocks


@dataclasses.dataclass
class Block:
    """Validation shared by the config dataclasses; `_PATH` is the block's dotted path.

    A dataclass itself (without fields) so that jsonargparse treats the subclasses as plain
    dataclasses (nested option groups) rather than as class_path/init_args subclass types.
    """

    _PATH: ClassVar[str] = ""

    @classmethod
    def _prepare_kwargs(cls, kwargs: dict) -> tuple:
        check_keys(kwargs, cls._PATH, [f.name for f in fields(cls)])
        return kwargs, ()

    def _record_given(self, names: tuple, autos: tuple) -> None:
        pass

    def __post_init__(self) -> None:
        self.validate()

    def _path(self, name: str) -> str:
        return f"{self._PATH}.{name}"

    def validate(self) -> None:
        """Check (and normalise) every field again, e.g. after assigning to one."""
        for f in fields(self):
            setattr(self, f.name, self._checked(f))
        self._check_combinations()

    def _checked(self, f: dataclasses.Field) -> Any:
        return _check_value(self._path(f.name), getattr(self, f.name), _hints(type(self))[f.name], f.metadata)

    def _check_combinations(self) -> None:
        pass


