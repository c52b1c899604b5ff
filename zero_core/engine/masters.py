"""Where the fp32 master shards live, and so how they step and how a reader gets them into memory.

``DeviceMasters``: beside the model, stepped tile by tile (optim/master_shards.py), always in memory.
``OffloadedMasters``: in host memory or swapped to NVMe (zero_core/offload), stepped on the host, brought in a
few tiles at a time for checkpoints and debugging reads. The engine picks one at setup and never asks which.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from zero_core import planning
from zero_core.fragments import Fragment
from zero_core.offload import OptimizerOffload
from zero_core.optim.master_shards import step_in_tiles


class DeviceMasters:
    """Masters on the model's device: always in memory, nothing to swap, nothing to release."""

    offload: Optional[OptimizerOffload] = None

    def __init__(self, config) -> None:
        self.config = config

    def bind(self, optimizers: list[torch.optim.Optimizer]) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer, units: list, used: list[list[bool]], inv_scale: float,
             clip_coef: Optional[torch.Tensor]) -> None:
        step_in_tiles(optimizer, units, used, inv_scale, clip_coef, planning.step_tile_numel(self.config))

    def forget_grads(self, units: Optional[list] = None) -> None:
        pass

    def resident(self, fragments: Optional[list[Fragment]] = None, state: bool = True, write: bool = True):
        return contextlib.nullcontext()

    def tiles(self, fragments: list[Fragment], write: bool = False) -> Iterator[list[Fragment]]:
        yield list(fragments)

    def in_file(self, fragment: Fragment) -> None:
        return None

    def shape_in_memory(self, master: torch.Tensor, key=None) -> Optional[torch.Size]:
        return None

    def lands_delayed_update(self) -> bool:
        return False

    def close(self) -> None:
        pass


class OffloadedMasters:
    """Masters and optimizer state on the host or on NVMe, behind one ``OptimizerOffload``."""

    def __init__(self, offload: OptimizerOffload) -> None:
        self.offload = offload

    def bind(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.offload.swapped.bind(optimizers)  # the state it swaps with the masters

    def step(self, optimizer: torch.optim.Optimizer, units: list, used: list[list[bool]], inv_scale: float,
             clip_coef: Optional[torch.Tensor]) -> None:
        self.offload.step(optimizer, units, used, inv_scale, clip_coef)  # tiled, on the host masters

    def forget_grads(self, units: Optional[list] = None) -> None:
        self.offload.forget_grads(units)  # host copies of the zeroed gradients are stale

    def resident(self, fragments: Optional[list[Fragment]] = None, state: bool = True, write: bool = True):
        if fragments is None:
            return self.offload.resident()
        masters = list({id(f.master): f.master for f in fragments}.values())
        return self.offload.resident(masters, state=state, write=write)

    def tiles(self, fragments: list[Fragment], write: bool = False) -> Iterator[list[Fragment]]:
        of_master: dict[int, list[Fragment]] = {}
        masters = []
        for fragment in fragments:
            if id(fragment.master) not in of_master:
                of_master[id(fragment.master)] = []
                masters.append(fragment.master)
            of_master[id(fragment.master)].append(fragment)
        for tile in self.offload.stream(masters, write):
            yield [f for master in tile for f in of_master[id(master)]]

    def in_file(self, fragment: Fragment):
        return self.offload.swapped.in_file(fragment.master, self.offload.parts)

    def shape_in_memory(self, master: torch.Tensor, key=None) -> Optional[torch.Size]:
        return self.offload.swapped.shape_in_memory(master, key)

    def lands_delayed_update(self) -> bool:
        """Wait for a delayed update in flight (offload/delayed_update.py); whether the model's parameters lag
        the masters since (the caller then writes the masters into the model)."""
        self.offload.settle(reading=False)  # (engine.close: a step backward started is finished, not refused)
        return self.offload.take_unwritten()

    def close(self) -> None:
        self.offload.close()


def masters_for(offload: Optional[OptimizerOffload], config):
    """The backend for what ``zero_core.offload.attach`` returned (None: the masters stay on the device)."""
    return DeviceMasters(config) if offload is None else OffloadedMasters(offload)
