"""How the config reports what it cannot accept: ZeroConfigError, whose message names the field's dotted path,
the "did you mean" suggestion for a misspelt key, and warnings that point at the user's line."""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any


class ZeroConfigError(ValueError):
    """A config key, value or file that ZeroConfig cannot accept; the message names the field."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _internal_frame(frame) -> bool:
    code = frame.f_code
    in_config = os.path.dirname(code.co_filename) == _PACKAGE_DIR
    return in_config or (code.co_filename == "<string>" and code.co_name == "__init__")  # dataclass __init__


def warn(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside the config package, so the warning points at user code."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _internal_frame(frame):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def did_you_mean(key: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_error(where: str, key: str, candidates: Iterable[str]) -> ZeroConfigError:
    """`where` is the full dotted path of the bad key; the suggestion is a bare key name."""
    candidates = sorted(candidates)
    match = did_you_mean(key, candidates)
    if match:
        hint = f"; did you mean {match!r}?"
    elif len(candidates) <= 12:
        hint = f"; valid keys: {', '.join(candidates)}"
    else:
        hint = "; docs/config.md lists the valid keys"
    return ZeroConfigError(f"unknown key {where!r}{hint}")


def type_error(path: str, expected: str, value: Any) -> ZeroConfigError:
    hint = ""
    if isinstance(value, str) and value == "auto":
        hint = "; 'auto' is only understood by ZeroConfig itself (kwargs, from_dict, from_file)"
    elif isinstance(value, str) and _is_number(value):
        hint = "; write the number without quotes"
    return ZeroConfigError(f"{path} must be {expected}, got {value!r} ({type(value).__name__}){hint}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def require_str_keys(d: Mapping, where: str = "the config") -> None:
    for key in d:
        if not isinstance(key, str):
            raise ZeroConfigError(f"keys of {where} must be strings, got {key!r} ({type(key).__name__})")


def check_keys(mapping: Mapping, prefix: str, valid: Iterable[str]) -> None:
    """Raise on the first non-string or unknown key of `mapping`, whose dotted path is `prefix`."""
    valid = set(valid)
    require_str_keys(mapping, prefix)
    for key in mapping:
        if key not in valid:
            raise unknown_key_error(f"{prefix}.{key}" if prefix else key, key, valid)
