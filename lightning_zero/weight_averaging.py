"""Lightning's weight-averaging callbacks under ZeroStrategy, and the engine's own average for validation.

``WeightAveraging`` (``EMAWeightAveraging``) keeps an ``AveragedModel``: a whole copy of the module, updated
from the module's parameters after each step and swapped into them (``param.data.copy_``) for validation.
- Stages 1 and 2 hold whole parameters, so the updates and the swaps see what DDP's do. Only the end differs:
  the callback's ``on_train_end`` copies the average into the parameters, not into the fp32 masters the engine
  steps and saves, so the strategy's ``on_train_end`` (after the callbacks') has the masters take them.
- Stage 3 partitions the parameters: the callback's copy would be the whole model on every rank and its update
  would read partitioned parameters. The strategy refuses it at setup and names the engine's sharded average
  (``weights_ema_decay``), which ``SwapInWeightsEMA`` swaps in for validation.
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

import zero_core

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # pragma: no cover - older Lightning has no such callback
    WeightAveraging = None


def _averaging_callbacks(trainer) -> list:
    if WeightAveraging is None:
        return []
    return [cb for cb in trainer.callbacks if isinstance(cb, WeightAveraging)]


def refuse_at_stage3(trainer, stage: int) -> None:
    """At stage 3, a ``WeightAveraging`` callback is a clear error that names the engine's average."""
    found = _averaging_callbacks(trainer)
    if stage == 3 and found:
        raise ValueError(
            f"{type(found[0]).__name__} cannot work under ZeroStrategy(stage=3): its AveragedModel keeps a whole "
            "copy of the model on every rank and reads the partitioned parameters after each step. Use the "
            "engine's sharded moving average instead: ZeroStrategy(stage=3, config={'weights_ema_decay': 0.999}) "
            "with the callback lightning_zero.SwapInWeightsEMA() for validation on the average, and "
            "`with zero_core.engine_of(model).ema_weights():` to export or test it (docs/lightning.md)")


def masters_take_averaged(trainer, engine) -> None:
    """Stages 1-2 at the end of fit: a ``WeightAveraging`` callback copied its average into the parameters;
    the fp32 masters (what checkpoints and later fits use) take those values, as DDP's parameters hold them."""
    if engine is None or engine.config.stage == 3 or not _averaging_callbacks(trainer):
        return
    for param in engine.module.parameters():  # replaced, not edited: every master takes the 16-bit average
        if param.requires_grad:
            zero_core.safe_set_full_fp32_param(param, param.detach())


class SwapInWeightsEMA(Callback):
    """Validate on the engine's moving average of the weights (``weights_ema_decay``), as ``EMAWeightAveraging``
    does with its own copy: swapped in at the start of each validation epoch, the trained weights back at its
    end (``engine.ema_weights()``). Works at stages 1-3."""

    def __init__(self) -> None:
        self._inside: Optional[object] = None

    def on_validation_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        engine = zero_core.engine_of(pl_module)
        if engine is None or engine.weights_ema is None:
            raise RuntimeError("SwapInWeightsEMA needs the engine's moving average: train with ZeroStrategy and "
                               "config={'weights_ema_decay': ...}")
        self._inside = engine.ema_weights()
        self._inside.__enter__()

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        inside, self._inside = self._inside, None
        if inside is not None:
            inside.__exit__(None, None, None)
