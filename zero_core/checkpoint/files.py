"""Durable file writing: a streaming safetensors writer with checksums, fsync, and the atomic directory swap.

The writer is ours (the format is a length, a JSON header and raw little-endian bytes) so that it can stream
views of the fp32 masters straight to disk: ``safetensors.torch.save_file`` refuses tensors that share storage,
which would force a copy of this rank's whole state, and it cannot hash while writing.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import secrets
import shutil
import zlib
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from zero_core.checkpoint.format import CheckpointError, MANIFEST, safetensors_dtype

_CHUNK = 1 << 24  # bytes hashed per read when verifying a file


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` on the CPU; no copy when it is already a contiguous CPU tensor."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class Pending(NamedTuple):
    """An entry whose tensor is not in memory yet: its dtype and shape, for the header. :func:`write_safetensors`
    takes the tensor from its ``data`` stream when it gets to the entry."""

    dtype: torch.dtype
    shape: tuple


def write_safetensors(path: Path, entries: Sequence[tuple[str, Union[torch.Tensor, Pending]]],
                      metadata: Optional[dict[str, str]] = None,
                      data: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> dict:
    """Write ``entries`` (key, tensor) in order; returns {"bytes", "sha256", "crc32": {key: crc32 of its bytes}}.

    An entry given as :class:`Pending` takes its tensor from ``data``, which yields (key, tensor) for those
    entries in the same order, each when it is written (a stream: e.g. NVMe-swapped optimizer state read one tile
    at a time, zero_core/checkpoint/save.py), or several consecutive flat parts of it under the same key (a piece
    bigger than a tile, a slice at a time); a part may be reused once the next one is asked for."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = dict(metadata)
    for key, tensor in entries:
        nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
        header[key] = {"dtype": safetensors_dtype(tensor.dtype), "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    stream = iter(data) if data is not None else iter(())
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
    digest, crcs, size = hashlib.sha256(), {}, 0
    with open(path, "wb") as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
        for key, tensor in entries:
            crc = 0
            for part in _pending_parts(stream, key, tensor) if isinstance(tensor, Pending) else [tensor]:
                raw_data = tensor_bytes(part)  # one tensor at a time: a GPU tensor is copied to the CPU alone
                f.write(raw_data)
                digest.update(raw_data)
                crc = zlib.crc32(raw_data, crc)
                size += len(raw_data)
            crcs[key] = crc
            part = raw_data = None  # a streamed tensor's memory may go before the stream makes the next one
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest(), "crc32": crcs}


def _pending_parts(stream: Iterator[tuple[str, torch.Tensor]], key: str, spec: Pending) -> Iterator[torch.Tensor]:
    """The tensor of a Pending entry: one from the stream, or consecutive flat parts of it under the same key
    (a piece streamed a slice at a time from NVMe, offload/piece_in_file.py), until its elements are complete."""
    total, done = math.prod(spec.shape), 0
    while True:
        got, tensor = next(stream, (None, None))
        whole = done == 0 and tensor is not None and tuple(tensor.shape) == tuple(spec.shape)
        if got != key or tensor.dtype != spec.dtype or not (whole or tensor.dim() == 1) \
                or done + tensor.numel() > total:
            found = "nothing" if got is None else f"{got!r} {tensor.dtype} {tuple(tensor.shape)}"
            raise CheckpointError(f"the stream of tensors to write gave {found} where {key!r} {spec.dtype} "
                                  f"{tuple(spec.shape)} was announced ({done} of its {total} elements written; a "
                                  "bug in the saving code; please report it)")
        yield tensor
        done += tensor.numel()
        if done == total:
            return


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entry list holds the renames and new files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path, token: str) -> Path:
    """The hidden directory a save writes into before it is renamed to ``path``."""
    return path.parent / f".{path.name}.tmp-{token}"


def check_replaceable(path: Path, marker: str = MANIFEST) -> None:
    """Refuse to replace anything but a missing path, an empty directory, or an earlier output (has ``marker``)."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"cannot save to '{path}': it is a file; give a directory path")
    if any(path.iterdir()) and not (path / marker).is_file():
        raise CheckpointError(f"refusing to replace '{path}': it is a non-empty directory without {marker}, so "
                              "not an earlier output of this library; choose another path or empty it")


def remove_stale_temps(path: Path) -> None:
    """Delete what interrupted saves to ``path`` left behind (they can never become valid)."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


class StagedDirectory:
    """A directory written in a hidden sibling (``temp``) and made visible at ``path`` only when complete.

    The one way this library publishes a directory (checkpoints, consolidations, 16-bit exports, node-local
    joins). Several ranks may write into ``temp``; one of them calls :meth:`prepare` first and :meth:`publish`
    once all are done, or :meth:`discard` on an error. One process: :func:`atomic_directory`.
    """

    def __init__(self, path: Path, token: str, marker: str = MANIFEST):
        self.path = Path(path)
        self.temp = temp_sibling(self.path, token)
        self.marker = marker  # a file that marks an earlier output of this library, which may be replaced

    def prepare(self) -> None:
        check_replaceable(self.path, self.marker)
        remove_stale_temps(self.path)
        self.temp.mkdir(parents=True)

    def publish(self) -> None:
        publish(self.temp, self.path)

    def discard(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: Union[str, "os.PathLike[str]"], marker: str = MANIFEST,
                     token: Optional[str] = None) -> Iterator[Path]:
    """``with atomic_directory(out) as temp:`` write the files into ``temp``; on leaving the block they appear
    at ``out`` all at once (replacing an earlier output that holds ``marker``), and on an error nothing at
    ``out`` changes. One process; see :class:`StagedDirectory` for several."""
    staged = StagedDirectory(Path(path).absolute(), token or secrets.token_hex(8), marker)
    staged.prepare()
    try:
        yield staged.temp
        staged.publish()
    except BaseException:
        staged.discard()
        raise


@contextlib.contextmanager
def atomic_file(path: Union[str, "os.PathLike[str]"]) -> Iterator[Path]:
    """``with atomic_file(out) as partial: torch.save(obj, partial)``: ``out`` is replaced by the complete file
    only, never left half-written."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def publish(temp: Path, path: Path) -> None:
    """Make the complete directory ``temp`` visible at ``path``, replacing an earlier one only now."""
    fsync_path(temp)
    if not path.exists():
        os.rename(temp, path)
    elif _exchange(temp, path):
        shutil.rmtree(temp)  # after the swap, temp holds the previous directory
    else:
        # No atomic swap here (not Linux, or the filesystem refuses): move the old one aside first. A crash
        # between the two renames leaves the old directory complete at .<name>.old-<token>.
        old = path.parent / f".{path.name}.old-{temp.name.rsplit('-', 1)[-1]}"
        os.rename(path, old)
        os.rename(temp, path)
        shutil.rmtree(old)
    fsync_path(path.parent)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries with Linux's renameat2(RENAME_EXCHANGE); False if unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0
