"""fp16 loss scaling with DeepSpeed's knobs and semantics.

Dynamic scaling (``loss_scale == 0``): the scale starts at ``2**initial_scale_power``; an overflow lowers it by
half once ``hysteresis`` overflows have been absorbed, never below ``min_loss_scale``; every
``loss_scale_window`` steps without overflow doubles it. A static scale (``loss_scale > 0``) never changes,
but an overflowing step is still skipped.
"""

from __future__ import annotations


class LossScaler:
    """Tracks the current loss scale; ``update`` is told whether the step overflowed on any rank."""

    def __init__(
        self,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        scale_factor: float = 2.0,
    ) -> None:
        self.dynamic = loss_scale == 0
        self.scale = float(2**initial_scale_power) if self.dynamic else float(loss_scale)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_loss_scale)
        self.factor = scale_factor
        self._hysteresis_left = hysteresis
        self._iteration = 0
        self._last_overflow = -1

    @classmethod
    def from_fp16_config(cls, fp16) -> "LossScaler":
        return cls(
            loss_scale=fp16.loss_scale,
            initial_scale_power=fp16.initial_scale_power,
            loss_scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_loss_scale=fp16.min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            self._update_dynamic(overflow)
        self._iteration += 1

    def _update_dynamic(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
            return
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if (self._iteration - self._last_overflow) % self.window == 0:
            if not self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "iteration": self._iteration,
            "last_overflow": self._last_overflow,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._iteration = int(state["iteration"])
        self._last_overflow = int(state["last_overflow"])
