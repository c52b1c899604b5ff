"""Where offloaded tensors live: host memory (pinned when asked and CUDA exists) and the copies to and from it."""

from __future__ import annotations

import torch


def pinning(pin_memory: bool) -> bool:
    """Page-locked host memory only helps (and only exists) when there is a CUDA device to copy from."""
    return pin_memory and torch.cuda.is_available()


def host_copy(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` holding ``tensor``'s values (never a view of it, even on a CPU run)."""
    out = torch.empty(tensor.shape, dtype=dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor.detach())
    return out


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Device -> host copy; asynchronous from CUDA into pinned memory (call :func:`wait_for_copies` before use)."""
    dst.copy_(src, non_blocking=src.is_cuda and dst.is_pinned())


def wait_for_copies(tensors: list[torch.Tensor]) -> None:
    """Make non_blocking device -> host copies visible to the CPU."""
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()
