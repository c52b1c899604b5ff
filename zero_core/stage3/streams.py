"""Stage 3's CUDA streams: all-gathers on one side stream, reduce-scatters on another, ordered with events.

On CUDA (docs/stage3.md, "On CUDA: side streams"; FSDP2 does the same), a coalesced gather's copy-in,
all-gather and copy-out run on the gather stream, so the next unit's gather, issued ahead by prefetch, overlaps
this unit's compute; a reduction's scaling, reduce-scatter and accumulation into the gradient shards run on the
reduce stream. The ordering is two rules, each one call here:

- ``issue``: a side stream first waits for the work the current (compute) stream has queued so far. Its inputs
  (shards, staged gradients) are then written, and memory the compute stream freed is no longer read by it.
- ``complete``: the side stream's work up to here (the wait for the collective, the copy-out or the
  accumulation) is queued on the side stream, then the current stream waits for it (an event). So the
  parameters, the gradient shards and a staging buffer handed back to the pool are used only after the side
  stream is done with them. Scratch allocated inside ``issue`` belongs to the side stream's allocator pool and
  is freed there, after its last use on that stream.

Elsewhere (the CPU, gloo) there are no streams: both contexts do nothing and everything runs in program order.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class SideStreams:
    """The gather and reduce streams of one device (both ``None`` off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.gather: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if cuda else None
        self.reduce: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if cuda else None


NONE = SideStreams(torch.device("cpu"))  # what units built outside a runtime (and every CPU unit) use


@contextlib.contextmanager
def _issue(stream: torch.cuda.Stream) -> Iterator[None]:
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


@contextlib.contextmanager
def _complete(stream: torch.cuda.Stream) -> Iterator[None]:
    consumer = torch.cuda.current_stream(stream.device)
    with torch.cuda.stream(stream):
        yield
    consumer.wait_stream(stream)


def issue(stream: Optional[torch.cuda.Stream]):
    """Run the block on ``stream`` once the current stream's queued work is done (nothing without a stream)."""
    return contextlib.nullcontext() if stream is None else _issue(stream)


def complete(stream: Optional[torch.cuda.Stream]):
    """Run the block on ``stream``, then make the current stream wait for it (nothing without a stream)."""
    return contextlib.nullcontext() if stream is None else _complete(stream)
