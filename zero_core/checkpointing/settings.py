"""What ``zero_core.checkpointing.checkpoint`` does with the inputs it keeps: the ``activation_checkpointing`` block
turned into one settings object, set by ``zero_core.setup`` (from the config) or by ``configure`` (DeepSpeed's
``deepspeed.checkpointing.configure``).

DeepSpeed's ``checkpoint(function, *args)`` takes no engine argument, so its settings are process-wide: one
``Settings`` object here, replaced (never mutated by callers) by each ``configure``. It also holds what lives
across checkpoints of one forward pass: the contiguous buffer, the stashes waiting for their recomputation (for
prefetch), the host copy stream, and counters that tests and benchmarks read (``stats()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from zero_core.checkpointing.profile import Profiler


@dataclass
class Stats:
    """Counters since the last ``configure`` (tests and benchmarks read them; they cost nothing to keep)."""

    stashed: int = 0  # checkpointed inputs kept away from their tensor (host copy, slot or partition)
    stashed_bytes: int = 0  # bytes those stashes hold on this rank
    host_bytes: int = 0  # of which in host memory
    restored: int = 0  # inputs brought back for a recomputation
    prefetched: int = 0  # host stashes whose copy back started ahead of their recomputation (CUDA: copy stream)
    synchronized: int = 0  # checkpoint boundaries that synchronized the accelerator
    slots_taken: int = 0  # contiguous buffer slots filled
    buffer_bytes: int = 0  # size of the contiguous buffer(s), allocated once


@dataclass
class Settings:
    partition_group: Optional[Any] = None  # a ProcessGroup: partition_activations' model-parallel group
    cpu: bool = False  # cpu_checkpointing
    contiguous: bool = False  # contiguous_memory_optimization
    number_checkpoints: Optional[int] = None
    synchronize: bool = False  # synchronize_checkpoint_boundary
    profiler: Optional[Any] = None  # a profile.Profiler when the block's profile is on
    stats: Stats = field(default_factory=Stats)
    pending: list = field(default_factory=list)  # weak references to stashes not yet restored, in forward order
    buffers: dict = field(default_factory=dict)  # (device, pinned) -> ContiguousBuffer (stash.py)
    copy_streams: dict = field(default_factory=dict)  # CUDA device -> the host copy stream

    @property
    def stashes(self) -> bool:
        """Whether the inputs are kept in any other way than torch.utils.checkpoint keeps them."""
        return self.partition_group is not None or self.cpu or self.contiguous

    @property
    def active(self) -> bool:
        """Whether ``checkpoint`` does anything torch.utils.checkpoint does not."""
        return self.stashes or self.synchronize or self.profiler is not None

    def copy_stream(self, device: torch.device):
        """The side stream host copies run on (one per CUDA device), so they overlap compute."""
        if device not in self.copy_streams:
            self.copy_streams[device] = torch.cuda.Stream(device)
        return self.copy_streams[device]

    def boundary(self, device: torch.device) -> None:
        """synchronize_checkpoint_boundary: wait for the accelerator at a checkpoint's start and end."""
        if self.synchronize:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.stats.synchronized += 1


_current = Settings()
_model_parallel_group = None  # the last group given to configure: kept when a later call gives none


def current() -> Settings:
    return _current


def _group_of(mpu_) -> Optional[Any]:
    """The model-parallel process group from DeepSpeed's ``mpu`` object (``get_model_parallel_group()``), a
    ``DeviceMesh`` of one dimension (a tensor-parallel mesh dimension: ``mesh["tp"]``) or a ProcessGroup."""
    if mpu_ is None:
        return None
    if hasattr(mpu_, "get_model_parallel_group"):
        return mpu_.get_model_parallel_group()
    if hasattr(mpu_, "get_group"):  # a DeviceMesh
        return mpu_.get_group()
    if isinstance(mpu_, dist.ProcessGroup):
        return mpu_
    raise TypeError(f"zero_core.checkpointing.configure: mpu_ must be an object with get_model_parallel_group() "
                    f"(DeepSpeed's mpu), a one-dimensional DeviceMesh or a ProcessGroup, got {type(mpu_).__name__}")


def configure(mpu_=None, deepspeed_config=None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> Settings:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings from ``deepspeed_config`` (a ZeroConfig, dict,
    path or None: its ``activation_checkpointing`` block), each overridden by a keyword given. ``mpu_`` names
    the model-parallel group ``partition_activations`` partitions over; a group given once is kept by later
    calls that give none (``zero_core.setup`` configures again from its config)."""
    from zero_core.config import ZeroConfig  # the config imports no torch-heavy modules; keep it lazy anyway

    config = ZeroConfig.coerce(deepspeed_config)
    config.warn_unimplemented()  # names each field not honoured (once per config object)
    block = config.activation_checkpointing
    global _current, _model_parallel_group
    if mpu_ is not None:
        _model_parallel_group = _group_of(mpu_)
    group = _model_parallel_group
    partition = block.partition_activations if partition_activations is None else partition_activations
    if partition and group is None:
        raise ValueError(
            "activation_checkpointing.partition_activations needs a model-parallel group to partition the "
            "checkpointed activations over: pass it with zero_core.checkpointing.configure(mpu_=...) (DeepSpeed's "
            "mpu, a tensor-parallel DeviceMesh dimension or a ProcessGroup) before zero_core.setup, or set "
            "partition_activations to false: pure data parallelism holds no redundant activations to partition")
    contiguous = block.contiguous_memory_optimization if contiguous_checkpointing is None else contiguous_checkpointing
    number = block.number_checkpoints if num_checkpoints is None else num_checkpoints
    if contiguous and number is None:
        raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints "
                         "(num_checkpoints): the checkpoints per forward pass, the buffer's slots")
    _current = Settings(
        partition_group=group if partition else None,
        cpu=block.cpu_checkpointing if checkpoint_in_cpu is None else checkpoint_in_cpu,
        contiguous=contiguous, number_checkpoints=number,
        synchronize=block.synchronize_checkpoint_boundary if synchronize is None else synchronize,
        profiler=Profiler() if (block.profile if profile is None else profile) else None)
    return _current


def reset() -> None:
    """DeepSpeed's ``reset``: forget the stashes of forward passes whose backward will not come (their graphs
    still held), so the contiguous buffer's slots are free again. A forward whose graph is dropped frees its
    stashes and slots by itself."""
    _current.pending.clear()
    for buffer in _current.buffers.values():
        buffer.reset()
