"""Small exchanges of plain data between ranks, as JSON in byte tensors: what ``dist.all_gather_object`` does
without pickle, so nothing a peer sends is ever executed (docs/reliability.md, "What crosses the store").
Used at setup and in debug checks, outside the counted collectives of the Communicator."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist

MAX_BYTES = 1 << 20  # a trace of module indices or a node name: far below


def all_gather_json(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list:
    """Every rank's JSON-serialisable ``obj`` (tuples come back as lists), in group rank order, on every rank."""
    world = dist.get_world_size(group)
    device = _device(group)
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"all_gather_json: {len(data)} bytes to send, more than the {MAX_BYTES} allowed")
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    sizes = [int(size) for size in sizes]
    longest = max(sizes)
    if longest > MAX_BYTES:
        raise RuntimeError(f"all_gather_json: a rank announced {longest} bytes, more than the {MAX_BYTES} allowed")
    local = torch.zeros(longest, dtype=torch.uint8)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(rows, local.to(device), group=group)
    return [_parse(bytes(row[:size].cpu().numpy()), r) for r, (row, size) in enumerate(zip(rows, sizes))]


def _parse(raw: bytes, rank: int) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise RuntimeError(f"all_gather_json: rank {rank} sent {len(raw)} bytes that are not UTF-8 JSON "
                           f"({type(error).__name__})") from None


def _device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """NCCL moves CUDA tensors only; every other backend here takes CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
