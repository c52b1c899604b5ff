"""``save_pretrained`` called on one rank of a ZeRO stage 3 model: a clear error that says how to save instead.

A script that saves ``if accelerator.is_main_process: model.save_pretrained(dir)`` (as it would under DDP,
where every rank holds the whole model) reaches, at stage 3, parameters that rank 0 holds 1/N of. PEFT's
``PeftModel.save_pretrained`` and transformers' ``PreTrainedModel.save_pretrained`` read them through
``model.state_dict()``, which would fail on the first partitioned parameter with the core's generic advice
(``GatheredParameters``: a collective, which one rank alone cannot join). So both are wrapped, process-locally
(nothing is written to the installed packages): without ``state_dict=``, on a model with a partitioned
parameter not gathered here, they raise an error naming the ways that work. Any other call (a ``state_dict``
given, as ``Trainer.save_model`` and the documented recipe pass it; stages 1 and 2; a model whose parameters are
all persistent) runs the original method unchanged.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

import zero_core

_WRAPPED = "_accelerate_zero_save_pretrained_wrapped"
_CLASSES = (("peft.peft_model", "PeftModel"), ("transformers.modeling_utils", "PreTrainedModel"))


def install_if_loaded() -> None:
    """Wrap ``save_pretrained`` of ``PeftModel`` and ``PreTrainedModel`` once each, if their module is imported."""
    for module_name, class_name in _CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and not cls.__dict__.get(_WRAPPED, False):
            cls.save_pretrained = _refusing_partitioned(cls.save_pretrained)
            setattr(cls, _WRAPPED, True)


def _refusing_partitioned(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if _given_state_dict(signature, self, save_directory, args, kwargs) is None:
            released = _first_released(self)
            if released is not None:
                raise RuntimeError(_message(type(self).__name__, released))
        return original(self, save_directory, *args, **kwargs)

    return save_pretrained


def _given_state_dict(signature: inspect.Signature, self, save_directory, args: tuple, kwargs: dict):
    """The ``state_dict`` argument, by name or position (transformers'), or in ``**kwargs`` (PEFT's); None if
    not given (or the arguments do not fit: the original method then reports that itself)."""
    try:
        arguments = signature.bind(self, save_directory, *args, **kwargs).arguments
    except TypeError:
        return None
    extra = next((arguments.get(p.name, {}) for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), {})
    return arguments.get("state_dict", extra.get("state_dict"))


def _first_released(model):
    """The name of the first parameter partitioned by stage 3 and not gathered on this rank now; None if none."""
    return next((name for name, param in model.named_parameters() if zero_core.is_released(param)), None)


def _message(class_name: str, released: str) -> str:
    return (
        f"{class_name}.save_pretrained without state_dict= reads the model's parameters on this rank alone, but "
        f"this model runs under ZeRO stage 3 and its parameters are partitioned across the ranks ('{released}' "
        "is not gathered here), so the file would not hold the trained weights. Save from every rank instead: "
        "with a Trainer (TRL's too), `trainer.save_model(dir)` on every rank (for a PEFT model it writes the "
        "adapter, fp32); in an Accelerate script, `state_dict = accelerator.get_state_dict(model)` on every rank "
        "(a collective; the whole state on rank 0), then on the main process "
        "`accelerator.unwrap_model(model).save_pretrained(dir, state_dict=state_dict)`."
    )
