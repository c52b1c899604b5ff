"""Where offloaded tensors live: host memory (pinned when asked and CUDA exists) and the copies to and from it."""

from __future__ import annotations

import threading
import weakref

import torch


def pinning(pin_memory: bool) -> bool:
    """Page-locked host memory only helps (and only exists) when there is a CUDA device to copy from."""
    return pin_memory and torch.cuda.is_available()


def host_empty(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked if ``pin``: an ordinary allocation whose pages are registered with
    CUDA in place (and unregistered when the tensor is freed). torch's pinned allocator rounds each block up to a
    power of two, which for offloaded buckets (hundreds of MB each) wastes a third of the host memory offloading is
    there to use (a 7B model's masters and gradients no longer fit a 128 GiB host); registration pins exactly the
    bytes asked for. Where CUDA refuses to register, torch's pinned allocator is used."""
    out = torch.empty(shape, dtype=dtype, device="cpu")
    if not pin or out.numel() == 0:
        return out
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(out.data_ptr(), out.untyped_storage().nbytes(), 0)) != 0:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    # The base tensor owns the registration: its owners (host master buckets, host gradient buffers) keep it
    # for as long as their views are used.
    weakref.finalize(out, cudart.cudaHostUnregister, out.data_ptr()).atexit = False  # exit frees it anyway
    return out


def host_copy(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` holding ``tensor``'s values (never a view of it, even on a CPU run)."""
    out = host_empty(tensor.shape, dtype, pin)
    out.copy_(tensor.detach())
    return out


# Elements per slice of a copy that changes dtype on the GPU: the cast's temporary is at most 64 MiB of fp32, not a
# whole bucket's worth of accelerator memory (which offloading is there to save).
_SLICE = 1 << 24
_streams: dict = {}  # (device, to the device) -> the stream those host <-> accelerator copies run on
_streams_lock = threading.Lock()
# Copies to the accelerator and copies from it on a stream each: a GPU has a copy engine per direction, so the
# write-back of stepped units (to it) runs beside the gradients of the units backward reduces next (from it)
# instead of queueing with them. False: one stream for both (benchmarks.gpu_offload --one-copy-stream).
SEPARATE_DIRECTIONS = True


def _copy_stream(device: torch.device, *, to_device: bool) -> "torch.cuda.Stream":
    """The stream of the copies in one direction: beside the compute stream, so that gradients leave during
    backward without holding up its kernels, and copies issued from the write-back thread run in the order it
    issues them."""
    key = (device, to_device or not SEPARATE_DIRECTIONS)
    with _streams_lock:  # the training thread and the write-back thread
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device)
        return stream


def copy_between(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between host memory and an accelerator (1-D tensors), either way, casting on the accelerator (slice by
    slice, so its temporary stays small), never on the CPU: device -> host casts, then copies; host -> device
    copies into a temporary, then casts. On the direction's copy stream after what the compute stream has queued, and
    asynchronous where the host side is pinned: call :func:`wait_for_copies` before the host reads what came in
    or writes what went out. Host to host is a plain copy."""
    if src.is_cuda == dst.is_cuda:
        dst.copy_(src)
        return
    device = src.device if src.is_cuda else dst.device
    asynchronous = (dst if src.is_cuda else src).is_pinned()
    stream = _copy_stream(device, to_device=not src.is_cuda)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        if src.dtype == dst.dtype:
            dst.copy_(src, non_blocking=asynchronous)
            return
        for start in range(0, src.numel(), _SLICE):
            piece = src[start : start + _SLICE]
            piece = piece.to(dst.dtype) if src.is_cuda else piece.to(device, non_blocking=asynchronous)
            dst[start : start + _SLICE].copy_(piece, non_blocking=asynchronous)


def copy_all(copies: list[tuple], arrive: bool = False) -> None:
    """``copies`` (dst, src) issued; with ``arrive``, also complete (gradients the step is about to read)."""
    with torch.no_grad():
        for dst, src in copies:
            copy_between(dst, src)
    if arrive and copies:
        wait_for_copies([src for _, src in copies])


def wait_for_copies(tensors: list[torch.Tensor]) -> None:
    """Complete the asynchronous copies to and from an accelerator: the host may then read what came in and
    write what went out, and the accelerator's compute stream sees what went in."""
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        for device in {t.device for t in tensors if t.is_cuda}:
            for key, stream in list(_streams.items()):
                if key[0] == device:
                    stream.synchronize()
            torch.cuda.current_stream(device).synchronize()
