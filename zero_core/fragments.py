"""What one rank holds of each parameter's fp32 training state, described the same way for every stage.

Checkpoints, the ``safe_get_*`` / ``safe_set_*`` debugging API and consolidation read and write model state
only through these fragments, so they work unchanged whatever the stage and the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from zero_core.layout import Range


@dataclass(frozen=True)
class Fragment:
    """Elements ``param_range`` of the flattened parameter ``name`` live on this rank.

    They sit at ``local`` inside ``master`` (the fp32 tensor the optimizer steps, whose per-element optimizer
    state has the same shape) and inside ``grad_shard`` (the reduced gradient, in the gradient dtype and scaled
    like the loss).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype  # the model parameter's dtype
    param_range: Range
    master: torch.Tensor
    grad_shard: torch.Tensor
    local: Range

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return self.shape.numel()

    def master_values(self) -> torch.Tensor:
        return self.master.detach()[self.local.as_slice()]

    def grad_values(self) -> torch.Tensor:
        return self.grad_shard[self.local.as_slice()]


def whole_value(engine, shape: torch.Size, fragments: list[Fragment], key: Optional[str] = None) -> torch.Tensor:
    """One parameter's fp32 master (``key`` None) or optimizer state ``key``, whole (``shape``) on every rank: each
    rank fills its ``fragments`` of it (:func:`fill_whole`) and one all-reduce sums them. A collective."""
    full = torch.zeros(shape.numel(), dtype=torch.float32, device=engine.device)
    fill_whole(engine, full, fragments, key)
    engine.comm.all_reduce(full)
    return full.view(shape)


def fill_whole(engine, full: torch.Tensor, fragments: list[Fragment], key: Optional[str] = None) -> None:
    """Write each of this rank's ``fragments`` of one parameter into ``full`` (the whole parameter, flat) at its
    ``param_range``: the fp32 master (``key`` None) or the per-element optimizer state ``key`` (a fragment without
    it is left as it is). ``engine`` is a ``contracts.CheckpointedEngine``.

    With NVMe offload only these fragments' masters (and, with ``key``, their state) are read in, and a piece
    bigger than a tile is read a slice at a time, ``key``'s region alone (engine.offload_in_file), so a read holds
    two slices of it, not the piece and all its state."""
    with engine.offload_resident([], state=False, write=False):  # (NVMe: a step in flight lands first)
        in_file = {id(f): engine.offload_in_file(f) for f in fragments}
        whole = [f for f in fragments if in_file[id(f)] is None]
        with engine.offload_resident(whole, state=key is not None, write=False):
            for fragment in fragments:
                piece, local = in_file[id(fragment)], fragment.local
                to_param = fragment.param_range.start - local.start  # piece index -> parameter element
                if piece is None:
                    values = values_in_memory(engine, fragment, key)
                    if values is not None:
                        full[fragment.param_range.as_slice()] = values
                elif key is None or engine.shape_in_memory(fragment.master, key) is not None:
                    start = local.start
                    for values in piece.read(key, local.start, local.end):
                        full[to_param + start: to_param + start + values.numel()] = values
                        start += values.numel()


def write_whole(engine, flat: torch.Tensor, fragments: list[Fragment], key: Optional[str] = None) -> None:
    """The reverse of :func:`fill_whole`: each fragment's master (``key`` None) or per-element optimizer state
    ``key`` takes its ``param_range`` of ``flat`` (the whole parameter, fp32). With NVMe offload a piece bigger than
    a tile is written a slice at a time (its master's slices into the model's parameter shard too), the others are
    read in and written out again."""
    with engine.offload_resident([], state=False, write=False):  # (NVMe: a step in flight lands first)
        in_file = {id(f): engine.offload_in_file(f) for f in fragments}
        whole = [f for f in fragments if in_file[id(f)] is None]
        with engine.offload_resident(whole, state=key is not None):
            for fragment in fragments:
                piece, local = in_file[id(fragment)], fragment.local
                to_param = fragment.param_range.start - local.start
                if piece is None:
                    target = values_in_memory(engine, fragment, key)
                    if target is not None:
                        target[...] = flat[fragment.param_range.as_slice()]
                elif key is None or engine.shape_in_memory(fragment.master, key) is not None:
                    piece.write(key, local.start, local.end,
                                lambda start, end, out: out.copy_(flat[to_param + start: to_param + end]))


def values_in_memory(engine, fragment: Fragment, key: Optional[str]) -> Optional[torch.Tensor]:
    """The view of ``fragment``'s master (``key`` None) or of its per-element optimizer state ``key`` (None where
    it has none), in memory (NVMe: inside ``engine.offload_resident``)."""
    if key is None:
        return fragment.master_values()
    value = engine.optimizer_state_of(fragment.master).get(key)
    if torch.is_tensor(value) and value.numel() == fragment.master.numel():
        return value[fragment.local.as_slice()]
    return None
