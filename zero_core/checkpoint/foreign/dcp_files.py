"""Read parts of a DCP (``torch.distributed.checkpoint``) directory without a process group.

The metadata (``.metadata``) is read with torch's own ``FileSystemReader``: it is a pickle written by torch, so
reading it trusts the directory as much as torch's ``dcp.load`` does (docs/checkpoints.md says so). Tensor
chunks go through the same reader (so torch's storage transforms apply), and each one is deserialised by
torch with ``weights_only=True``. Non-tensor entries (``bytes``: hyper-parameters, pickled Python state) are
read here with ``torch.load(weights_only=True)`` too, never with torch's default planner, which unpickles them
with ``weights_only=False``.

A read names the rows it wants; only the stored chunks that overlap them are read.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint.format import CheckpointError

METADATA = ".metadata"


def is_dcp_directory(path: Path) -> bool:
    """A DCP directory; one with data files but no metadata is refused here (dcp.save writes the metadata
    last, so the save did not finish), rather than reported as a checkpoint without our manifest."""
    if not path.is_dir():
        return False
    if (path / METADATA).is_file():
        return True
    if any(path.glob("__*.distcp")):
        raise CheckpointError(f"'{path}' holds DCP data files (.distcp) but no {METADATA}: dcp.save writes it last, "
                              "so that save did not finish; load an earlier checkpoint")
    return False


class DCPFiles:
    """The metadata of one DCP directory, and reads of its entries by key."""

    def __init__(self, directory: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = Path(directory)
        self.reader = FileSystemReader(str(self.directory))
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as error:
            raise CheckpointError(f"cannot read '{self.directory / METADATA}' as DCP metadata: {error}") from None
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.entries: dict[str, Any] = dict(self.metadata.state_dict_metadata)
        self._check_files()

    def _check_files(self) -> None:
        """Every data file the metadata points to is there and long enough, before anything is loaded."""
        needed: dict[str, tuple[int, str]] = {}
        for index, info in self.metadata.storage_data.items():
            end = info.offset + info.length
            if end > needed.get(info.relative_path, (-1, ""))[0]:
                needed[info.relative_path] = (end, index.fqn)
        for file, (end, key) in sorted(needed.items()):
            path = self.directory / file
            if not path.is_file():
                raise CheckpointError(f"the DCP checkpoint '{self.directory}' is missing its data file '{file}' "
                                      f"(it holds '{key}', among others)")
            if path.stat().st_size < end:
                raise CheckpointError(f"the DCP data file '{path}' is truncated: {path.stat().st_size} bytes, the "
                                      f"metadata needs {end} (for '{key}')")

    def is_tensor(self, key: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return isinstance(self.entries.get(key), TensorStorageMetadata)

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].properties.dtype

    def check_chunks(self, key: str) -> None:
        """The stored chunks of tensor ``key`` hold each element once (no gap: a rank's shard lost from the
        metadata; no overlap: a layout this reader does not take, e.g. replicas saved without deduplication)."""
        entry = self.entries[key]
        numel = math.prod(entry.size)
        stored = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        if stored != numel:
            raise CheckpointError(f"the DCP entry '{key}' of shape {tuple(entry.size)} is stored in "
                                  f"{len(entry.chunks)} chunks of {stored} elements in all, not {numel}: a chunk "
                                  "layout this reader does not support, or damaged metadata")

    def read_rows(self, key: str, first: int, last: int) -> torch.Tensor:
        """Rows ``[first, last)`` (along dim 0) of tensor ``key``; the whole tensor if it is 0-d."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        shape = self.shape(key)
        offsets = [first] + [0] * (len(shape) - 1) if shape else []
        sizes = [last - first] + shape[1:] if shape else []
        out = torch.empty(sizes, dtype=self.dtype(key))
        wanted = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, self.entries[key], [wanted])
        covered = sum(math.prod(item.lengths) for item in items)
        if covered != out.numel():
            raise CheckpointError(f"the DCP checkpoint's chunks of '{key}' cover {covered} of the {out.numel()} "
                                  f"elements of rows [{first}, {last}): its metadata is damaged")
        self._read(LoadPlan(items), _IntoTensor(out), key)
        return out

    def read_all_bytes(self, keys: list[str]) -> dict[str, Any]:
        """Non-tensor entries (in one pass over the files), each unpickled with ``weights_only=True``: plain
        Python values only."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import _create_read_item_for_byteio

        if not keys:
            return {}
        items = [_create_read_item_for_byteio(MetadataIndex(k), 0, MetadataIndex(k), 0, 0) for k in keys]
        planner = _IntoValues()
        self._read(LoadPlan(items), planner, ", ".join(keys[:3]) + ("..." if len(keys) > 3 else ""))
        values = {}
        for key in keys:
            try:
                values[key] = torch.load(planner.values[key], weights_only=True)
            except Exception as error:
                raise CheckpointError(
                    f"the DCP entry '{key}' in '{self.directory}' is not a plain value (a number, string, tuple, "
                    f"list or dict) that loads without running code: {_reason(error)}") from None
        return values

    def _read(self, plan, planner, key: str) -> None:
        try:
            self.reader.read_data(plan, planner).wait()
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(f"cannot read '{key}' from the DCP checkpoint '{self.directory}': "
                                  f"{type(error).__name__}: {error}") from None


def _reason(error: Exception) -> str:
    """torch's weights_only refusal is a page long; its one informative line names the class."""
    lines = str(error).splitlines()
    return next((line.strip() for line in lines if "Unsupported global" in line), lines[0] if lines else "")


class _IntoTensor:
    """The part of LoadPlanner that FileSystemReader.read_data calls: each read lands in a view of ``out``."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def resolve_tensor(self, item) -> torch.Tensor:
        view = self.out
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, item, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item, value: io.BytesIO) -> None:
        raise CheckpointError(f"the DCP entry '{item.storage_index.fqn}' holds bytes where a tensor was expected")


class _IntoValues:
    """Keeps the raw bytes of non-tensor entries by key, unpickled by the caller."""

    def __init__(self):
        self.values: dict[str, io.BytesIO] = {}

    def load_bytes(self, item, value: io.BytesIO) -> None:
        self.values[item.dest_index.fqn] = value

    def resolve_tensor(self, item):
        raise CheckpointError(f"the DCP entry '{item.storage_index.fqn}' holds a tensor where bytes were expected")

    def commit_tensor(self, item, tensor) -> None:
        pass
