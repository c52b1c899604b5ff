"""Reading a DeepSpeed config file: JSON or YAML whose top level is a mapping; every failure names the file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zero_core.config.errors import ZeroConfigError

SUFFIXES = (".json", ".yaml", ".yml")


def read_config_file(path: str | os.PathLike) -> Mapping:
    """Read a .json/.yaml/.yml file whose top level is a mapping; every failure names the file."""
    p = Path(path)
    if p.suffix.lower() not in SUFFIXES:
        raise ZeroConfigError(f"config file '{p}' has suffix {p.suffix!r}; use one of {', '.join(SUFFIXES)}")
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ZeroConfigError(f"config file '{p}' does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ZeroConfigError(f"cannot read config file '{p}': {err}") from None
    data = _parse_json(p, text) if p.suffix.lower() == ".json" else _parse_yaml(p, text)
    if not isinstance(data, Mapping):
        raise ZeroConfigError(f"config file '{p}' must hold a mapping at the top level, "
                              f"got {type(data).__name__}")
    return data


def _no_duplicates(pairs: list) -> dict:
    # json keeps the last duplicate silently; DeepSpeed rejects duplicates, and so do we.
    out = {}
    for key, value in pairs:
        if key in out:
            raise ZeroConfigError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_json(p: Path, text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        where = f"line {err.lineno} column {err.colno}"
        raise ZeroConfigError(f"config file '{p}' is not valid JSON: {err.msg} at {where}") from None
    except ZeroConfigError as err:
        raise ZeroConfigError(f"config file '{p}' is not valid: {err}") from None


def _parse_yaml(p: Path, text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as err:
        raise ZeroConfigError(f"config file '{p}' is not valid YAML: {err}") from None


def _yaml_loader():
    """A SafeLoader that reads 5e8 as a number: YAML 1.1 wants a dot (5.0e8), DeepSpeed users don't."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    number = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", number, list("-+0123456789"))
    return Loader
