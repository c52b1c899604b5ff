"""Helpers shared by the scripts the Accelerate tests launch (imported by path, next to them)."""

import importlib.util
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration

from accelerate_zero import ZeroAccelerator, ZeroPlugin

ROOT = Path(__file__).resolve().parents[3]
STEPS = 12
ACCUM = 2


def load_example():
    """examples/accelerate_train.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("accelerate_train", ROOT / "examples" / "accelerate_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_state() -> None:
    """Forget the previous Accelerator's settings (the process group stays)."""
    AcceleratorState._reset_state()
    GradientState._reset_state()


def make_accelerator(kind, **kwargs):
    """kind: "ddp" (plain Accelerate), "env" (ZeroAccelerator from the environment), or a ZeroPlugin config."""
    fresh_state()
    kwargs.setdefault("gradient_accumulation_steps", ACCUM)
    kwargs.setdefault("dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True))
    if kind == "ddp":
        return Accelerator(**kwargs)
    if kind == "env":
        return ZeroAccelerator(**kwargs)
    return ZeroAccelerator(zero_plugin=ZeroPlugin(config=kind), **kwargs)


def to_lists(state: dict) -> dict:
    return {k: v.detach().float().cpu().reshape(-1).tolist() for k, v in state.items()}


def write_json(path, data) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        Path(path).write_text(json.dumps(data))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def same_on_all_ranks(values) -> bool:
    """Whether a list of floats is identical on every rank (e.g. gradient norms)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor)
    return all(torch.equal(g, tensor) for g in gathered)
