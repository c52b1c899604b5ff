"""Count every collective at one level for every implementation: the methods of ``ProcessGroup``.

``torch.distributed``'s functions (``all_reduce``, ``all_gather_single`` and its deprecated alias
``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``, ...) all end in one method
call on the ProcessGroup object, so counting there sees each collective exactly once whichever name the caller
used. A re-entrancy guard counts only the outermost call, in case one method is ever implemented on top of
another. DDP's own all-reduce runs inside its C++ reducer and never reaches Python: `allreduce_comm_hook`
routes it through ``dist.all_reduce``, so it is counted here too.

Elements are the paper's unit: the size of the whole (unsharded) tensor a collective covers (reduce-scatter
input, all-gather output, all-reduce and broadcast tensor). ``paper_volume`` weighs an all-reduce as 2 (a
reduce-scatter plus an all-gather, the paper's 2Ψ for data parallelism) and everything else as 1.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

# DDP's built-in averaging, but in Python (through dist.all_reduce), so the counter sees it.
allreduce_comm_hook = allreduce_hook

PAPER_WEIGHT = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "reduce": 1}


def _numel(tensors) -> int:
    if torch.is_tensor(tensors):
        return tensors.numel()
    if isinstance(tensors, (list, tuple)):
        return sum(_numel(t) for t in tensors)
    return 0


def _arg(position: int) -> Callable:
    """Elements of the ``position``-th argument (after self), however deeply it nests lists of tensors."""
    return lambda args, kwargs: _numel(args[position]) if len(args) > position else 0


# method name -> (kind, elements from (args, kwargs)). Outputs for gathers, inputs for reductions.
_METHODS = {
    "allreduce": ("all_reduce", _arg(0)),
    "allreduce_coalesced": ("all_reduce", _arg(0)),
    "broadcast": ("broadcast", _arg(0)),
    "reduce": ("reduce", _arg(0)),
    "all_gather_single": ("all_gather", _arg(0)),
    "_allgather_base": ("all_gather", _arg(0)),
    "allgather": ("all_gather", _arg(0)),
    "allgather_coalesced": ("all_gather", _arg(0)),
    "allgather_into_tensor_coalesced": ("all_gather", _arg(0)),
    "all_gather_single_coalesced": ("all_gather", _arg(0)),
    "reduce_scatter_single": ("reduce_scatter", _arg(1)),
    "_reduce_scatter_base": ("reduce_scatter", _arg(1)),
    "reduce_scatter": ("reduce_scatter", _arg(1)),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", _arg(1)),
    "reduce_scatter_single_coalesced": ("reduce_scatter", _arg(1)),
    "alltoall": ("other", _arg(0)),
    "alltoall_base": ("other", _arg(0)),
    "all_to_all_single": ("other", _arg(0)),
    "gather": ("other", _arg(0)),
    "scatter": ("other", _arg(0)),
    "send": ("other", _arg(0)),
    "recv": ("other", _arg(0)),
    "recv_anysource": ("other", _arg(0)),
    "barrier": ("barrier", lambda args, kwargs: 0),
}


class CommCounter:
    """Patches ``dist.ProcessGroup`` while installed; ``enabled`` switches counting on and off."""

    def __init__(self) -> None:
        self.enabled = False
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "elements": 0})
        self._local = threading.local()
        self._originals: dict[str, Callable] = {}

    # -- install ---------------------------------------------------------------------------------------------
    def install(self) -> "CommCounter":
        if self._originals:
            raise RuntimeError("CommCounter is already installed")
        cls = dist.ProcessGroup
        for name, (kind, elements) in _METHODS.items():
            original = getattr(cls, name, None)
            if original is None:
                continue  # an older or newer torch without this method
            self._originals[name] = original
            setattr(cls, name, self._wrap(original, kind, elements))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist.ProcessGroup, name, original)
        self._originals.clear()

    def _wrap(self, original: Callable, kind: str, elements: Callable) -> Callable:
        counter = self

        @functools.wraps(original)
        def counted(pg, *args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0 and counter.enabled:
                entry = counter._stats[kind]
                entry["calls"] += 1
                entry["elements"] += elements(args, kwargs)
            counter._local.depth = depth + 1
            try:
                return original(pg, *args, **kwargs)
            finally:
                counter._local.depth = depth

        return counted

    # -- results ---------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._stats.clear()

    def stats(self) -> dict[str, dict[str, int]]:
        return {kind: dict(entry) for kind, entry in self._stats.items()}


def paper_volume(stats: dict[str, dict[str, int]]) -> int:
    """Elements in the paper's accounting: all-reduce counts twice, every other collective once."""
    return sum(PAPER_WEIGHT.get(kind, 1) * entry["elements"] for kind, entry in stats.items() if kind != "barrier")


def engine_volume(engine_stats: dict[str, dict[str, int]]) -> int:
    """The same accounting over ``ZeroEngine.comm_stats()`` (the engine's own counters)."""
    return paper_volume({k: v for k, v in engine_stats.items() if v.get("calls", 0)})


def kinds(stats: Iterable[dict]) -> list[str]:
    """Every collective kind present in any of ``stats``, in a fixed order."""
    order = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "other", "barrier"]
    present = {kind for entry in stats for kind in entry}
    return [k for k in order if k in present] + sorted(present - set(order))
