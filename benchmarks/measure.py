"""Model-state bytes and resident memory of one rank, measured the same way for every implementation.

Bytes are counted per storage, each storage once, in class order (parameters, gradients, fp32 master,
optimizer state, other), so a view seen twice, or a gradient that is a view of a DDP bucket, is counted once
and under the first class that reaches it. Sharded tensors (FSDP2's DTensor, DeepSpeed stage 3's
``ds_tensor``) are counted by their local shard.
"""

from __future__ import annotations

import resource
from typing import Iterable, Iterator

import torch

CLASSES = ("params", "grads", "fp32_master", "optimizer_state", "buffers")
MODEL_STATE_CLASSES = ("params", "grads", "fp32_master", "optimizer_state")


def local_tensor(tensor):
    """The rank-local data of a tensor: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class StorageCounter:
    """Sums storage sizes, each storage once, into named classes."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = {name: 0 for name in CLASSES}

    def add(self, cls: str, tensors: Iterable) -> None:
        if cls not in self.bytes:
            raise ValueError(f"unknown memory class {cls!r}; expected one of {', '.join(CLASSES)}")
        for tensor in tensors:
            if not torch.is_tensor(tensor):
                continue
            storage = local_tensor(tensor).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
                continue
            self.seen.add(storage.data_ptr())
            self.bytes[cls] += storage.nbytes()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def parameter_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter's own storage: DeepSpeed stage 3 keeps it in ``ds_tensor`` and empties ``data``."""
    for param in module.parameters():
        yield getattr(param, "ds_tensor", None) if hasattr(param, "ds_tensor") else param


def grad_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    return (p.grad for p in module.parameters() if p.grad is not None)


def reachable_tensors(obj, max_depth: int = 4) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) for every tensor reachable from ``obj`` through attributes, lists and dicts."""
    seen: set[int] = set()
    stack = [("", obj, 0)]
    while stack:
        path, value, depth = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if torch.is_tensor(value):
            yield path, value
        elif depth < max_depth:
            stack.extend((f"{path}.{k}", v, depth + 1) for k, v in _children(value))


def _children(value) -> list:
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (list, tuple, set)):
        return [(str(i), v) for i, v in enumerate(value)]
    if isinstance(value, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
        return []
    attributes = getattr(value, "__dict__", None)
    return list(attributes.items()) if isinstance(attributes, dict) else []


def model_states_per_param(memory: dict, numel: int) -> float:
    return sum(memory.get(c, 0) for c in MODEL_STATE_CLASSES) / numel


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    current = peak
    try:
        with open("/proc/self/statm") as statm:
            current = int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        pass
    return current, peak
