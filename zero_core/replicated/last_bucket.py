"""Stage 2: the bucket reduced last needs no Python per gradient once its staging buffer is open.

Stage 2's hook on each parameter (grad_reducer._grad_ready) stages the gradient and launches the buckets it
completes, so that buckets are reduced as backward goes. The bucket reduced last (position 0 in the reducer's
order, the parameters backward reaches last) is never launched from a hook: the end-of-backward flush launches
it. Once its first gradient has opened its staging buffer, each of its parameters' ``.grad`` is its slot there
and autograd accumulates in place, so its other hooks would only count arrivals. ``swap`` points them at the
``append`` of a list instead (a builtin: no Python runs), and ``restore``, at the flush, counts that list and
puts the Python hooks back. A model whose parameters fit one bucket (the CPU proxy's 288, docs/benchmarks.md)
then runs one Python hook per backward instead of one per gradient.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from zero_core.grad_notes import GradNotes


class LastBucketHooks:
    """The hooks of the last bucket's parameters, swapped between the Python hook and a list's append."""

    __slots__ = ("arrivals", "swapped", "_entries", "_index_of")

    def __init__(self) -> None:
        self.arrivals: list[torch.Tensor] = []  # parameters whose gradient arrived while swapped
        self.swapped = False
        self._entries: list[tuple[dict, int, Callable]] = []  # (hook dict, key, the Python hook): held here too
        self._index_of: dict[int, int] = {}  # id(parameter) -> its index in its group

    def add(self, param: torch.Tensor, index: int, hook: Callable, handle) -> None:
        # the Python hook stays referenced here: autograd may be calling it when swap() replaces its entry
        self._entries.append((handle.hooks_dict_ref(), handle.id, hook))
        self._index_of[id(param)] = index

    def swap(self) -> None:
        append = self.arrivals.append
        for hooks, key, _ in self._entries:  # the reducer's close() drops these entries with its hooks
            hooks[key] = append  # autograd reads the dict when it calls the hooks
        self.swapped = True

    def restore(self, seen: Optional[set], notes: Optional[GradNotes]) -> None:
        """The Python hooks again; the indices of the parameters that got a gradient meanwhile join ``seen``,
        and the parameters themselves the engine's ``notes`` (which the Python hook records them in)."""
        if not self.swapped:
            return
        for hooks, key, hook in self._entries:
            hooks[key] = hook
        self.swapped = False
        arrivals = self.arrivals[:]
        self.arrivals.clear()
        if seen is not None:
            seen.update(map(self._index_of.__getitem__, map(id, arrivals)))
        if notes is not None:
            notes.record_all(arrivals)
