"""``activation_checkpointing.profile``: how long checkpointed functions take to run and to recompute.

DeepSpeed's ``profile`` times each checkpoint's forward and backward with its synchronized timers. Here each
checkpointed function is timed when it runs in forward and again when backward recomputes it (the accelerator
is synchronized around both, so the times are the function's, at the cost of the overlap; a debugging switch).
Once per forward-backward pass (when the next pass's first checkpoint starts, or on ``log_profile()``) rank 0
logs one line through the ``logging`` module, logger ``zero_core.checkpointing``, level INFO:

    activation checkpoints: 24 forwards 0.412 s, 24 recomputations 0.398 s (recompute/forward 0.97)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger("zero_core.checkpointing")


@dataclass
class Timings:
    """The current pass's totals (``last`` keeps the previous pass's, which tests and benchmarks read)."""

    forwards: int = 0
    forward_s: float = 0.0
    recomputations: int = 0
    recompute_s: float = 0.0

    def summary(self) -> str:
        ratio = f" (recompute/forward {self.recompute_s / self.forward_s:.2f})" if self.forward_s > 0 else ""
        return (f"activation checkpoints: {self.forwards} forwards {self.forward_s:.3f} s, "
                f"{self.recomputations} recomputations {self.recompute_s:.3f} s{ratio}")


class Profiler:
    def __init__(self) -> None:
        self.current = Timings()
        self.last = Timings()

    def timed(self, function: Callable, device: torch.device) -> Callable:
        """``function`` timed: its first call is the checkpoint's forward, later ones its recomputations."""
        calls = 0

        def run(*args, **kwargs):
            nonlocal calls
            forward = calls == 0
            calls += 1
            if forward and self.current.recomputations:  # the previous pass's backward is over
                self.log()
            _synchronize(device)
            start = time.perf_counter()
            try:  # torch stops a recomputation early by raising once it has what backward needs
                return function(*args, **kwargs)
            finally:
                _synchronize(device)
                elapsed = time.perf_counter() - start
                if forward:
                    self.current.forwards += 1
                    self.current.forward_s += elapsed
                else:
                    self.current.recomputations += 1
                    self.current.recompute_s += elapsed

        return run

    def log(self) -> Timings:
        """Log the pass so far (rank 0) and start the next; returns what was logged."""
        done, self.last, self.current = self.current, self.current, Timings()
        if done.forwards and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(done.summary())
        return done


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
