"""A sharded exponential moving average of the weights, kept beside the fp32 master shards.

Each rank averages only its own master pieces (1/N of the model), in fp32, on the device the masters live on:
the accelerator, or host memory under ``offload_optimizer: cpu``. The update follows torch's
``AveragedModel`` with ``get_ema_multi_avg_fn(decay)``: the first update copies the weights, every later one
is ``ema.lerp_(weights, 1 - decay)``, once per optimizer step that applied (an fp16 overflow or a step without
gradients changes neither the weights nor the average). A piece the average has not seen yet (a parameter
group added later) starts from its weights at its first update.

Swapping the average in for validation exchanges the values of each master piece and its average in place, so
no second copy of the shard is kept; the engine then refreshes the model's parameters from the masters
(engine.ema_weights). Checkpoints save the averages as one more tensor kind per fragment (checkpoint/save.py).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

EMA_KIND = "weights_ema"  # the tensor kind of the averages in a checkpoint's fragments


class WeightsEMA:
    """The moving averages of this rank's master pieces, keyed by piece."""

    def __init__(self, decay: float) -> None:
        self.decay = float(decay)
        self.updates = 0  # optimizer steps averaged so far (all optimizers together)
        self._average: dict[nn.Parameter, torch.Tensor] = {}
        self._seen: set[nn.Parameter] = set()  # pieces averaged at least once (the first update copies)

    def track(self, masters: Iterable[nn.Parameter]) -> None:
        """Allocate an average for each new piece, equal to its weights (``AveragedModel``'s starting copy)."""
        for master in masters:
            if master not in self._average:
                self._average[master] = master.detach().clone()

    def average_of(self, master: nn.Parameter) -> torch.Tensor:
        """The average of one master piece (its shape, fp32, on its device)."""
        average = self._average.get(master)
        if average is None:
            raise KeyError("this master piece has no weights average (a bug in the engine: please report it)")
        return average

    def update(self, masters: list[nn.Parameter]) -> None:
        """After an optimizer step of ``masters``: average them in (torch's get_ema_multi_avg_fn)."""
        self.track(masters)
        first = [m for m in masters if m not in self._seen]
        if first:
            torch._foreach_copy_([self._average[m] for m in first], [m.detach() for m in first])
            self._seen.update(first)
        rest = [m for m in masters if id(m) not in {id(f) for f in first}] if first else masters
        if rest:
            torch._foreach_lerp_([self._average[m] for m in rest], [m.detach() for m in rest], 1.0 - self.decay)
        self.updates += 1

    @torch.no_grad()
    def exchange(self, masters: list[nn.Parameter]) -> None:
        """Swap the values of each piece and its average (twice restores both exactly)."""
        self.track(masters)
        for master in masters:
            average = self._average[master]
            held = master.detach().clone()
            master.detach().copy_(average)
            average.copy_(held)

    def load(self, master: nn.Parameter, values: Optional[torch.Tensor], where: slice) -> None:
        """A checkpoint's averages for elements ``where`` of ``master`` (None: the checkpoint had none, so the
        average starts again from the loaded weights)."""
        self.track([master])
        average = self._average[master]
        if values is None:
            average[where] = master.detach()[where]
            self._seen.discard(master)
        else:
            average[where] = values.to(average.dtype)
            self._seen.add(master)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._average.values())
