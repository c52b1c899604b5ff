"""``save_pretrained`` called on one rank of a ZeRO stage 3 model: a clear error that says how to save instead.

A script that saves on one rank (``if is_main_process: model.save_pretrained(dir)``, as it would under DDP,
where every rank holds the whole model) reaches, at stage 3, parameters that this rank holds 1/N of. PEFT's
``PeftModel.save_pretrained`` and transformers' ``PreTrainedModel.save_pretrained`` read them through
``model.state_dict()``, which would fail on the first partitioned parameter with the core's generic advice, or
(with a gather) wait for ranks that never join it. So both are wrapped, process-locally (nothing is written to
the installed packages): without ``state_dict=``, on a model with a partitioned parameter not gathered here,
they raise an error naming the ways that work. Any other call (a ``state_dict`` given; stages 1 and 2; a model
whose parameters are all persistent, or gathered on every rank by ``GatheredParameters``) runs the original
method unchanged.

Front-end neutral: each front-end installs it at stage 3 with its own advice (accelerate_zero/save_pretrained.py,
lightning_zero/strategy.py and lightning_zero/fabric.py); the classes are only looked up where already imported.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

from zero_core.stage3.partitioned_param import is_released

_WRAPPED = "_zero_core_save_pretrained_wrapped"
_CLASSES = (("peft.peft_model", "PeftModel"), ("transformers.modeling_utils", "PreTrainedModel"))
# How to save under each front-end that installed the check, in the order installed (the message names all).
_ADVICE: dict[str, str] = {}
GATHERED_RECIPE = (
    "or, in any script, on every rank `with zero_core.GatheredParameters(list(model.parameters())):` and inside "
    "it `model.save_pretrained(dir)` on the main rank only (each rank holds the whole model meanwhile)"
)


def install_if_loaded(front_end: str, advice: str) -> None:
    """Wrap ``save_pretrained`` of ``PeftModel`` and ``PreTrainedModel`` once each, if their module is imported;
    ``advice`` (how to save under ``front_end``) goes into the error."""
    _ADVICE[front_end] = advice
    for module_name, class_name in _CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and not cls.__dict__.get(_WRAPPED, False):
            cls.save_pretrained = _refusing_partitioned(cls.save_pretrained)
            setattr(cls, _WRAPPED, True)


def _refusing_partitioned(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if given_state_dict(signature, self, save_directory, args, kwargs) is None:
            released = _first_released(self)
            if released is not None:
                raise RuntimeError(_message(type(self).__name__, released))
        return original(self, save_directory, *args, **kwargs)

    return save_pretrained


def given_state_dict(signature: inspect.Signature, self, save_directory, args: tuple, kwargs: dict):
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
    return next((name for name, param in model.named_parameters() if is_released(param)), None)


def _message(class_name: str, released: str) -> str:
    return (
        f"{class_name}.save_pretrained without state_dict= reads the model's parameters on this rank alone, but "
        f"this model runs under ZeRO stage 3 and its parameters are partitioned across the ranks ('{released}' "
        "is not gathered here), so the file would not hold the trained weights. Save from every rank instead: "
        + "; ".join(_ADVICE.values()) + "; " + GATHERED_RECIPE + "."
    )
