"""``ZeroPlugin``: the ZeRO settings an Accelerate run uses, and where they come from.

A plugin holds one ``zero_core.ZeroConfig`` (DeepSpeed's ``zero_optimization`` names) and nothing else of
its own. It is built from code (``ZeroPlugin(config=..., stage=...)``) or from the environment that
``accelerate-zero launch`` (or the user) sets for every worker:

- ``ACCELERATE_ZERO_CONFIG``: the ZeRO settings as JSON text (what ``accelerate-zero launch`` hands over);
- ``ACCELERATE_ZERO_CONFIG_FILE``: a DeepSpeed-style JSON/YAML file (a bare block or a whole config);
- ``ACCELERATE_ZERO_STAGE``: the stage, overriding whatever the config says;
- ``ACCELERATE_ZERO_AUTOCAST``: ``true`` for Accelerate-style mixed precision (see ``autocast`` below).

How the run's own settings (mixed precision, gradient accumulation) combine with the config is in
``resolve.py``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import yaml

from zero_core import ZeroConfig, ZeroConfigError

ENV_CONFIG = "ACCELERATE_ZERO_CONFIG"
ENV_CONFIG_FILE = "ACCELERATE_ZERO_CONFIG_FILE"
ENV_STAGE = "ACCELERATE_ZERO_STAGE"
ENV_AUTOCAST = "ACCELERATE_ZERO_AUTOCAST"
DEFAULT_STAGE = 2  # DeepSpeedPlugin's default too, so `ZeroAccelerator()` with nothing set behaves alike

ConfigLike = Union[ZeroConfig, dict, str, "os.PathLike[str]", None]


@dataclass
class ZeroPlugin:
    """ZeRO settings for :class:`~accelerate_zero.ZeroAccelerator`.

    Args:
        config: a ``ZeroConfig``, a dict (bare ``zero_optimization`` block or whole DeepSpeed config) or a
            path to a DeepSpeed JSON/YAML file. None: stage 2 with DeepSpeed's defaults.
        stage: ZeRO stage 1, 2 or 3; overrides ``config``'s stage when given.
        autocast: keep fp32 parameters and run the forward under ``torch.autocast`` in Accelerate's
            ``mixed_precision`` dtype, exactly as plain Accelerate does (DeepSpeed's ``torch_autocast``; a whole
            DeepSpeed config with ``torch_autocast: {enabled: true}`` turns it on too). Off by default: the
            engine then trains in 16 bits (16-bit parameters and gradients, fp32 master weights).
    """

    config: ConfigLike = None
    stage: Optional[int] = None
    autocast: bool = False
    source: str = field(default="code", repr=False)  # where the settings came from, for error messages

    def __post_init__(self) -> None:
        given = self.config
        self.config = copy.deepcopy(ZeroConfig.coerce(given))  # never mutate the caller's object
        self.autocast = bool(self.autocast) or _torch_autocast_enabled(given)
        if self.stage is None and given is None:
            self.stage = DEFAULT_STAGE
        if self.stage is not None:
            self.config.stage = self.stage
            self.config.validate()
        self.stage = self.config.stage
        if self.stage == 0:
            raise ZeroConfigError(
                f"zero_optimization.stage is 0 (ZeRO off) in the ZeRO settings from {self.source}: set stage 1, 2 "
                "or 3, or use a plain accelerate.Accelerator for DDP"
            )

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "ZeroPlugin":
        """The plugin described by ``ACCELERATE_ZERO_CONFIG`` / ``_CONFIG_FILE`` / ``_STAGE`` (stage 2 if none)."""
        env = os.environ if environ is None else environ
        inline, path, stage = env.get(ENV_CONFIG), env.get(ENV_CONFIG_FILE), env.get(ENV_STAGE)
        autocast = _parse_flag(ENV_AUTOCAST, env.get(ENV_AUTOCAST))
        if inline and path:
            raise ZeroConfigError(
                f"both {ENV_CONFIG} (set by accelerate-zero launch from its --config file) and {ENV_CONFIG_FILE}={path} "
                f"are set: unset {ENV_CONFIG_FILE}, or put its settings in the zero.yaml's zero_optimization block"
            )
        config, source = None, "the default (no ACCELERATE_ZERO_* variable set)"
        if inline:
            config, source = _parse_inline(inline), f"${ENV_CONFIG}"
        elif path:
            config, source = os.fspath(path), f"${ENV_CONFIG_FILE}={path}"
        return cls(config=config, stage=_parse_stage(stage), autocast=autocast, source=source)


def _parse_inline(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ZeroConfigError(f"{ENV_CONFIG} is not valid JSON ({err}); it should hold a zero_optimization block") from None
    if not isinstance(value, dict):
        raise ZeroConfigError(f"{ENV_CONFIG} must hold a JSON object (a zero_optimization block), got {type(value).__name__}")
    return value


def _parse_flag(name: str, text: Optional[str]) -> bool:
    if text is None or text.strip() == "":
        return False
    value = text.strip().lower()
    if value not in {"true", "false", "1", "0", "yes", "no"}:
        raise ZeroConfigError(f"{name} must be true or false, got {text!r}")
    return value in {"true", "1", "yes"}


def _torch_autocast_enabled(given: ConfigLike) -> bool:
    """DeepSpeed's top-level ``torch_autocast.enabled`` in a whole config (a dict or a file); ZeroConfig itself
    reads past that key."""
    data = given
    if isinstance(given, (str, os.PathLike)):
        try:
            with open(given, encoding="utf-8") as handle:
                data = json.load(handle) if os.fspath(given).endswith(".json") else yaml.safe_load(handle)
        except (OSError, ValueError, yaml.YAMLError):
            return False  # ZeroConfig.coerce has already read this file and reported any problem
    block = data.get("torch_autocast") if isinstance(data, Mapping) else None
    return isinstance(block, Mapping) and block.get("enabled") is True


def _parse_stage(text: Optional[str]) -> Optional[int]:
    if text is None or text.strip() == "":
        return None
    if text.strip() not in {"1", "2", "3"}:
        raise ZeroConfigError(f"{ENV_STAGE} must be 1, 2 or 3, got {text!r}")
    return int(text)
