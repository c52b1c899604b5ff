"""What stages 2 and 3 share around gradient reduction: the queue of reductions in flight, and the backward session.

``ReductionQueue``: reduce-scatters (or all-reduces) issued asynchronously, oldest first. With ``overlap_comm``
up to ``depth`` stay in flight while the next bucket fills; each holds its bucket's buffers, so the depth is
what bounds the gradient scratch memory (the estimator counts ``depth + 1`` buckets). Without overlap each one
completes as soon as it is issued.

``BackwardSession``: one backward as the reducers see it. Under ``no_sync`` (``sync`` False) gradients stay in
``param.grad`` and the session notes that they wait (``unsynced_grads``: the next synced backward, or the step,
reduces them). The first gradient of a synced backward opens the session: it queues the end-of-backward callback
on autograd's engine once (it runs when the whole backward is over, FSDP2's and DDP's flush point), and calls
the owner's ``on_open``.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

from torch.autograd import Variable

Job = TypeVar("Job")


class ReductionQueue(Generic[Job]):
    """Reductions in flight, oldest first; ``complete(job)`` waits for one and applies its result."""

    __slots__ = ("_complete", "depth", "overlap", "_jobs")

    def __init__(self, complete: Callable[[Job], None], depth: int, overlap: bool) -> None:
        self._complete = complete
        self.depth = depth
        self.overlap = overlap
        self._jobs: list[Job] = []

    def push(self, job: Job) -> None:
        """A reduction was issued: keep it in flight, completing the oldest beyond the depth."""
        self._jobs.append(job)
        self.drain(self.depth if self.overlap else 0)

    def drain(self, keep: int = 0) -> None:
        """Complete the oldest reductions until at most ``keep`` are still in flight."""
        while len(self._jobs) > keep:
            self._complete(self._jobs.pop(0))

    def drop(self) -> None:
        """Forget the reductions in flight without waiting (teardown after the process group is gone)."""
        self._jobs = []

    def __len__(self) -> int:
        return len(self._jobs)


class BackwardSession:
    """The no_sync mode, the waiting local gradients, and the end-of-backward callback of one reducer."""

    __slots__ = ("sync", "unsynced_grads", "open", "_on_open", "_on_end")

    def __init__(self, on_end: Callable[[], None], on_open: Callable[[], None] = lambda: None) -> None:
        self.sync = True  # False under no_sync: gradients accumulate in param.grad
        self.unsynced_grads = False  # some param.grad holds a gradient not reduced yet
        self.open = False  # a synced backward runs and its end-of-backward callback is queued
        self._on_open = on_open
        self._on_end = on_end

    def grad_arrived(self) -> bool:
        """A parameter's gradient was accumulated. True when it is to be reduced in this backward; False under
        no_sync, where it waits in ``param.grad``."""
        if not self.sync:
            self.unsynced_grads = True
            return False
        if not self.open:
            self.begin()
        return True

    def begin(self) -> None:
        """A synced backward starts (its first gradient, or a stage-3 module's backward): queue the flush once."""
        if not self.open:
            Variable._execution_engine.queue_callback(self._on_end)
            self.open = True
            self._on_open()

    def close(self) -> None:
        """The backward's reductions are flushed: the next gradient opens a new session."""
        self.open = False


def unused_parameters_message(names: Sequence[str]) -> str:
    """The error for trainable parameters that got no gradient in a backward (stages 2 and 3)."""
    return (
        f"parameters got no gradient in this backward: {', '.join(names)}. Set "
        "zero_optimization.ignore_unused_parameters=true if that is expected, or freeze them."
    )
