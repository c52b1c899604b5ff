"""``zero.yaml``: Accelerate's usual config keys plus a DeepSpeed-style ``zero_optimization:`` block.

``read_launch_config`` splits the file and validates both halves (Accelerate's keys with Accelerate's own
loader, the block with ``ZeroConfig``); ``launch_settings`` turns it into the config file Accelerate's launcher
reads and the environment every worker inherits. ``starter_yaml`` is what ``accelerate-zero config`` writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import torch
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

from zero_core import ZeroConfigError

from .offload_keys import merge_offload_keys
from .plugin import ENV_AUTOCAST, ENV_CONFIG, ENV_CONFIG_FILE, ZeroPlugin

ZERO_KEY = "zero_optimization"
AUTOCAST_KEY = "torch_autocast"  # DeepSpeed's top-level key for fp32 parameters + torch.autocast
_DEEPSPEED_RUN_KEYS = {"fp16", "bf16", "bfloat16", "gradient_clipping", "gradient_accumulation_steps",
                       "activation_checkpointing"}
_OWN_LAUNCHERS = {"NO", "MULTI_GPU", "MULTI_CPU"}


@dataclass
class LaunchConfig:
    path: Path
    accelerate: dict  # the keys Accelerate's config loader reads
    zero: dict  # the zero_optimization block, as written
    autocast: bool = False  # torch_autocast: {enabled: true}


def read_launch_config(path) -> LaunchConfig:
    """Read and validate ``path``; every error names the file and the key."""
    path = Path(path)
    data = _load_yaml(path)
    zero = data.pop(ZERO_KEY, None)
    if not isinstance(zero, dict):
        got = "no" if zero is None else f"a {type(zero).__name__} as"
        raise ZeroConfigError(
            f"{path} has {got} '{ZERO_KEY}:' block; add one holding DeepSpeed's zero_optimization settings (e.g. "
            "'zero_optimization: {stage: 2}'), or run `accelerate-zero config` to write a starter file"
        )
    zero = merge_offload_keys(path, data, zero)  # Accelerate's offload_*_device / _nvme_path keys
    ZeroPlugin(config=zero, source=str(path))  # validates names, values and the stage
    autocast = _read_autocast(path, data.pop(AUTOCAST_KEY, None))
    _check_accelerate_keys(path, data)
    return LaunchConfig(path=path, accelerate=data, zero=zero, autocast=autocast)


def _read_autocast(path: Path, block) -> bool:
    if block is None:
        return False
    if not isinstance(block, dict) or set(block) - {"enabled"} or not isinstance(block.get("enabled"), bool):
        raise ZeroConfigError(
            f"{path}: '{AUTOCAST_KEY}:' takes only 'enabled: true' or 'enabled: false' (the autocast dtype is "
            f"Accelerate's mixed_precision), got {block!r}"
        )
    return block["enabled"]


def _load_yaml(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no launch config at {path}: create one with `accelerate-zero config --output {path}`")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ZeroConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ZeroConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def _check_accelerate_keys(path: Path, data: dict) -> None:
    known = {f.name for f in fields(ClusterConfig)}
    for key in data:
        if key in _DEEPSPEED_RUN_KEYS:
            raise ZeroConfigError(
                f"{path}: top-level key '{key}' is a DeepSpeed setting: move it inside the '{ZERO_KEY}:' block "
                "(mixed precision is Accelerate's 'mixed_precision:' key)"
            )
        if key not in known:
            raise ZeroConfigError(f"{path}: unknown key '{key}'; Accelerate's config keys are: {', '.join(sorted(known))}")
    precision = data.get("mixed_precision", "no")
    if precision is not False and str(precision).lower() not in ("no", "bf16", "fp16"):
        raise ZeroConfigError(
            f"{path}: mixed_precision must be 'no', 'bf16' or 'fp16' (the ZeRO engine trains in it), got {precision!r}"
        )
    kind = str(data.get("distributed_type", "NO"))
    if kind not in _OWN_LAUNCHERS:
        raise ZeroConfigError(
            f"{path}: distributed_type is {kind}, but accelerate-zero runs ZeRO itself on plain processes: use "
            "MULTI_GPU (or leave the key out); DeepSpeed or FSDP settings have no effect here"
        )
    with temporary_yaml(launch_settings(data)[0]) as temp:
        try:
            load_config_from_file(temp)  # Accelerate's own checks, on exactly what its launcher will read
        except (ValueError, TypeError) as err:
            raise ZeroConfigError(f"{path}: {str(err).replace(temp, str(path))}") from None


def launch_settings(accelerate: dict) -> tuple[dict, dict[str, str]]:
    """(Accelerate config for its launcher, extra environment) for ``accelerate`` keys from a zero.yaml.

    Several processes on one machine always go through torchrun (``MULTI_GPU``): Accelerate's ``MULTI_CPU``
    starts a single process there. Without GPUs (or with ``use_cpu``) the workers get ``ACCELERATE_USE_CPU``,
    so they run on CPU with gloo instead of each believing it is alone.
    """
    config = dict(accelerate)
    if config.get("mixed_precision") is False:
        config["mixed_precision"] = "no"  # YAML 1.1 reads an unquoted `no` as false
    processes = int(config.get("num_processes", 1))
    cpu = bool(config.get("use_cpu")) or not torch.cuda.is_available()
    keep_mpirun = config.get("distributed_type") == "MULTI_CPU" and config.get("mpirun_config")
    if processes > 1 and not keep_mpirun:
        config["distributed_type"] = "MULTI_GPU"
    config.setdefault("distributed_type", "NO")
    config.setdefault("num_processes", processes)
    env = {"ACCELERATE_USE_CPU": "true"} if cpu else {}
    if cpu:
        config["use_cpu"] = True
    return config, env


def worker_environment(launch: LaunchConfig) -> dict[str, str]:
    """What every worker inherits: the ZeRO block (as written, so "auto" and unset fields stay so)."""
    if os.environ.get(ENV_CONFIG_FILE):
        raise ZeroConfigError(
            f"{ENV_CONFIG_FILE}={os.environ[ENV_CONFIG_FILE]} is set, and {launch.path} has its own "
            f"'{ZERO_KEY}:' block: unset the variable, or merge its settings into the block"
        )
    _, env = launch_settings(launch.accelerate)
    env[ENV_CONFIG] = json.dumps(launch.zero)
    if launch.autocast:
        env[ENV_AUTOCAST] = "true"
    return env


@contextlib.contextmanager
def temporary_yaml(data: dict) -> Iterator[str]:
    """A YAML file holding ``data`` for the duration of a ``with`` block; yields its path."""
    handle, path = tempfile.mkstemp(prefix="accelerate-zero-", suffix=".yaml")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            yaml.safe_dump(data, out)
        yield path
    finally:
        os.unlink(path)
