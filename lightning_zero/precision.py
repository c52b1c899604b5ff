"""Precision plugins for the ZeRO strategies: the engine owns the dtypes, the plugin only feeds it.

The engine casts the model to 16 bits and keeps fp32 master weights; fp16 loss scaling is the engine's too. So
the plugin does not cast the module; it casts inputs to the parameter dtype, runs "-mixed" steps under
autocast (tensors created inside forward in fp32 still meet 16-bit weights), and for "-true" makes 16 bits the
default dtype while the model is built and run, as Lightning's HalfPrecision does. Backward, the optimizer step
and clipping go to the engine (``ZeroPrecision.engine``, set by the strategy).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch.utils._pytree import tree_map

from .config import PRECISION_BLOCKS
from .optimizer import optimizer_index

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
          "16-mixed": torch.float16, "16-true": torch.float16}
_warnings = WarningCache()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t, data)


class _ZeroPrecisionMixin:
    """What the Trainer and Fabric plugins share: dtypes and contexts."""

    precision: str

    def _init_precision(self, precision: str) -> None:
        if precision not in DTYPES:
            raise ValueError(f"ZeRO precision must be one of {', '.join(DTYPES)}; got {precision!r}")
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.device_type = "cpu"  # for autocast; the strategy sets its root device's type
        self.engine = None

    def convert_module(self, module):
        return module  # the engine casts (stage 3 unit by unit, as it partitions)

    def convert_input(self, data: Any) -> Any:
        return data if self.dtype == torch.float32 else _cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return data if self.dtype == torch.float32 else _cast_floating(data, torch.get_default_dtype())

    def tensor_init_context(self):
        return _default_dtype(self.dtype) if self.precision.endswith("-true") else contextlib.nullcontext()

    def module_init_context(self):
        return self.tensor_init_context()

    def forward_context(self):
        if self.precision.endswith("-mixed"):
            return torch.autocast(self.device_type, dtype=self.dtype)
        return self.tensor_init_context()

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError(
                f"{type(self).__name__} works only under a ZeRO strategy (strategy='zero1'/'zero2'/'zero3' after "
                "`import lightning_zero`, or ZeroStrategy(...)); no ZeRO engine is set up yet"
            )
        return self.engine


def clip_grad_value(engine, clip_val: float, optimizer=None) -> None:
    """Clamp every reduced gradient element (of ``optimizer``'s parameters, default all) to ±clip_val, as
    torch's clip_grad_value_ after DDP's all-reduce."""
    optimizer = optimizer_index(engine, optimizer)
    engine.reduce_gradients(optimizer)
    limit = float(clip_val) * engine.loss_scale  # shards hold loss-scaled gradients under fp16
    for fragment in engine.fragments(optimizer):
        fragment.grad_values().clamp_(-limit, limit)


class ZeroPrecision(_ZeroPrecisionMixin, Precision):
    """The Trainer's precision plugin under ``ZeroStrategy``: ``32-true``, ``bf16-mixed``, ``bf16-true``,
    ``16-mixed`` (fp16 with the engine's dynamic loss scaling) or ``16-true``."""

    def __init__(self, precision: PrecisionFlag = "32-true") -> None:
        self._init_precision(precision)

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        if is_overridden("backward", model):
            _warnings.warn(
                "You have overridden `LightningModule.backward`, but ZeroStrategy ignores it: the ZeRO engine runs "
                "backward itself (it scales the loss under fp16). Move that logic to `on_before_backward`."
            )
        self._require_engine().backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        self._require_engine()
        if model.automatic_optimization and closure_result is None:
            # training_step returned None: Lightning skips this batch; every rank must return None for it.
            optimizer.zero_grad()  # the engine's, for this optimizer's parameters
            return None
        return optimizer.step(**kwargs)

    def clip_gradients(
        self,
        optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val <= 0:
            return
        engine = self._require_engine()
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            clip_grad_value(engine, clip_val, optimizer)
        else:
            engine.clip_grad_norm_(clip_val, 2.0, optimizer=optimizer_index(engine, optimizer))


class ZeroFabricPrecision(_ZeroPrecisionMixin, FabricPrecision):
    """Fabric's precision plugin under ``ZeroFabricStrategy`` (same flags as :class:`ZeroPrecision`)."""

    def __init__(self, precision: PrecisionFlag = "32-true") -> None:
        self._init_precision(precision)


def precision_flag_of(plugin) -> Optional[str]:
    """The flag a generic Lightning/Fabric precision plugin stands for, if ZeRO can honour it."""
    flag = getattr(plugin, "precision", None)
    generic = type(plugin).__name__ in {"Precision", "MixedPrecision", "HalfPrecision", "DeepSpeedPrecision",
                                        "FSDPPrecision"}
    return flag if generic and flag in PRECISION_BLOCKS else None


def as_zero_precision(plugin, cls: type):
    """``plugin`` as a ZeRO plugin of class ``cls``: generic plugins are translated, others refused by name."""
    if plugin is None or isinstance(plugin, cls):
        return plugin
    flag = precision_flag_of(plugin)
    if flag is None:
        raise TypeError(
            f"ZeroStrategy cannot train with the {type(plugin).__name__} precision plugin "
            f"(precision={getattr(plugin, 'precision', '?')!r}): the ZeRO engine handles dtypes itself. Use "
            f"precision= one of {', '.join(DTYPES)}, or plugins=[{cls.__name__}(...)]"
        )
    return cls(flag)
