"""One offloaded step's parts on their way to the thread that steps them (overlapped_step.py): the contract
between the step call (and, with ``overlap_with_backward``, backward) that hands parts over and the thread that
takes them. Until the step call the thread takes parts as backward hands them over (the last layers first); after
it, in the order the next forward reads them, so the forward waits for each in turn."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from zero_core.optim.master_shards import TileEntry

if TYPE_CHECKING:
    from zero_core.contracts import Part
    from zero_core.offload.overlapped_step import UpdateInFlight


class Work(NamedTuple):
    """One part's update for the thread: its stepped pieces (``entries``), their state and host gradients."""

    part: "Part"  # a stage-3 unit or a stages 1-2 flat group
    entries: list[TileEntry]
    states: list
    grads: list[torch.Tensor]
    handle: "UpdateInFlight"  # finished by the thread once the part's shards hold its update
    arrived: Optional["torch.cuda.Event"]  # the gradients' copy to the host (made during backward), or None
    inv_scale: float
    clip: Optional[torch.Tensor]
    bucket: Optional[int] = None  # stage 2: the one bucket of the group backward reduced (None: all its pieces)


class StepQueue:
    """One step's parts for the thread. With ``overlap_with_backward`` they come in while backward reduces them,
    then the rest at the step call; until that call the thread takes them as they come (the last layers first),
    after it in the order the next forward reads them (so what backward left is stepped from the first layer on,
    and the forward waits for each in turn)."""

    def __init__(self, kernels: dict) -> None:
        self.kernels = kernels  # chunked_step.piece_kernels: the step's hyperparameters, as of its first part
        self.early: list[tuple[int, Optional[int]]] = []  # (id(part), bucket or None) added during backward
        self._cond = threading.Condition()
        self._ready: list[Work] = []
        self._order: Optional[dict[int, int]] = None  # set by the step call: position in the next forward
        self._failed = False

    @property
    def closed(self) -> bool:
        return self._order is not None

    def put(self, work: Work) -> None:
        with self._cond:
            if self._failed:
                work.handle.finish(None)
                return
            self._ready.append(work)
            self._cond.notify()

    def close(self, works: list[Work], order: dict[int, int]) -> None:
        """The step call: the remaining parts; the thread ends once every part is stepped."""
        with self._cond:
            self._order = order
            for work in works:
                self._ready.append(work)
            if self._failed:
                self._finish_all()
            self._cond.notify()

    def take(self) -> Optional[Work]:
        """The next part to step (None: the step is done), waiting for backward's next one if need be."""
        with self._cond:
            while not self._ready and self._order is None:
                self._cond.wait()
            if not self._ready:
                return None
            if self._order is None:
                return self._ready.pop(0)
            order = self._order
            index = min(range(len(self._ready)), key=lambda i: order.get(id(self._ready[i].part), len(order)))
            return self._ready.pop(index)

    def fail(self) -> None:
        """The thread failed: every waiter is released now, and any part added later at once."""
        with self._cond:
            self._failed = True
            self._finish_all()

    def _finish_all(self) -> None:
        for work in self._ready:
            work.handle.finish(None)
        self._ready.clear()
