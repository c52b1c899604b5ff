"""Which parameters got a gradient since the engine last looked, noted without running Python per gradient.

The engine needs, for each step, the parameters that got a gradient (No gradient, no step), whether any did,
and (fp16) whether one came from a backward outside ``engine.backward``. A Python hook per parameter costs about
a microsecond per gradient, 0.3-0.5 ms of a step of the CPU proxy's 288 parameters (docs/benchmarks.md); here
each parameter's hook is the ``append`` of one list, a builtin that autograd calls without running Python code,
and the engine reads the list when it needs the notes (``take``).

Once a step's gradients were reduced (clipping, ``reduce_gradients``), a further gradient has to raise in its own
backward, before it is lost: ``arm`` points every hook at the engine's Python note until ``disarm``.

The list holds the parameters that got a gradient until it is taken. The hooks hold the list, not the engine
(weak_hooks.py says why), and the engine empties the list when it goes (``weakref.finalize``), so a model
dropped between a backward and its step is not kept alive by its own hooks.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


class GradNotes:
    """One engine's record of gradient arrivals: cheap hooks normally, the engine's Python note when armed."""

    __slots__ = ("arrivals", "record", "armed", "_armed_note", "_plain", "_entries")

    def __init__(self, armed_note: Callable[[torch.Tensor], None]) -> None:
        self.arrivals: list[torch.Tensor] = []
        self._plain = self.arrivals.append
        self._armed_note = armed_note  # holds the engine weakly (weak_hooks.weakly)
        self.record = self._plain  # what every hook calls now (stage 2's reducer hook calls it too)
        self.armed = False
        self._entries: list[tuple[dict, int]] = []  # (a parameter's hook dict, our hook's key in it)

    def hook(self, params: Iterable[torch.Tensor]) -> list:
        """Note each gradient of ``params`` from now on; returns the hooks' handles."""
        handles = []
        for param in params:
            handle = param.register_post_accumulate_grad_hook(self.record)
            self._entries.append((handle.hooks_dict_ref(), handle.id))
            handles.append(handle)
        return handles

    def take(self) -> list[torch.Tensor]:
        """The parameters noted since the last call (one entry per gradient), forgotten here."""
        if not self.arrivals:
            return []
        arrivals = self.arrivals[:]
        self.arrivals.clear()
        return arrivals

    def arm(self) -> None:
        """From now on each gradient runs the engine's note (which raises for a gradient it would lose)."""
        if not self.armed:
            self._point_hooks_at(self._armed_note)
            self.armed = True

    def disarm(self) -> None:
        if self.armed:
            self._point_hooks_at(self._plain)
            self.armed = False

    def _point_hooks_at(self, hook: Callable[[torch.Tensor], None]) -> None:
        # autograd reads each parameter's hook dict when it calls the hooks, so replacing the entry is enough
        self.record = hook
        for hooks, key in self._entries:
            if hooks is not None and key in hooks:
                hooks[key] = hook
