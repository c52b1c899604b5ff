"""Gradients that give their memory back between steps, as ``zero_grad(set_to_none=True)`` does in plain
PyTorch: after a step, stage 1's full gradient buffer and the gradient shards of stages 2 and 3 free their
storage, and the next step allocates it again where a reduction first needs it (stage 1: the parameters' ``.grad``
are None meanwhile and autograd allocates them, as in plain training). So the peak at the end of forward (every
activation alive) does not also hold a gradient per parameter: 2 bytes per parameter in bf16, 1.7 GiB of a 873M
model's peak on one GPU (docs/benchmarks.md).

They are born that way too: after setup no gradient holds memory until the first reduction.

With ``offload_optimizer`` (device cpu) at stages 2-3 a gradient shard (stage 2: a reduce bucket's) gives its
memory back as soon as its copy to the host is under way (``MovedToHost``), so backward does not keep a gradient
per parameter on the accelerator.

Only on CUDA, where the caching allocator hands the same blocks back at no cost. On a CPU a freed buffer goes back
to the operating system and its pages fault in again every step, so there the storage is kept
(``RELEASE_ON_CPU`` turns the release on anyway, for tests). Views of the storage stay valid while it is empty,
and its owner restores it before anything reads or writes through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

RELEASE_ON_CPU = False  # tests set it (in their worker processes) to run the release where it is otherwise off


def releases(device: torch.device) -> bool:
    """Whether gradient shards on ``device`` are freed between steps."""
    return device.type == "cuda" or RELEASE_ON_CPU


def release(storage: torch.Tensor) -> None:
    """Free ``storage``'s memory (a tensor that owns all of its storage); its views keep their shape."""
    storage.untyped_storage().resize_(0)


def is_released(storage: torch.Tensor) -> bool:
    return storage.numel() > 0 and storage.untyped_storage().nbytes() == 0


def restore(storage: torch.Tensor) -> None:
    """Allocate ``storage``'s memory again (uninitialised), on the current stream."""
    storage.untyped_storage().resize_(storage.numel() * storage.element_size())


@dataclass
class MovedToHost:
    """A reduced gradient shard that ``offload_optimizer`` copied to host memory, whose accelerator memory was then
    given back (stages 2-3; the ZeRO-Offload paper keeps reduced gradients on the host only). ``copy_in`` puts the
    values back into the bucket views it is given, for a reader that needs them on the accelerator again (an
    accumulating reduction, the debugging API); ``norms`` holds each bucket's norm by norm type, taken before the
    memory went (None for an empty bucket): what clipping and fp16's overflow check read instead."""

    copy_in: Callable[[list[torch.Tensor]], None]
    norms: dict[float, list[Optional[torch.Tensor]]]


class KnownNorm(NamedTuple):
    """A gradient shard's norm taken before its memory was given back (``MovedToHost``), standing for the shard
    where norms are computed (engine/norms.py)."""

    value: torch.Tensor  # 0-d fp32, on the shard's device
    device: torch.device  # the shard's
    dtype: torch.dtype  # the shard's
