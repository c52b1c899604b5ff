"""Hugging Face ``generate()`` on a stage 3 model: every rank must keep running forward passes until all ranks
are done, since each forward gathers the partitioned weights collectively.

transformers runs its generation loop that way (``synced_gpus=True``) on its own only when it sees DeepSpeed
ZeRO-3 or FSDP. We do not pose as FSDP (``_is_fsdp_managed_module`` also changes how torch.compile treats a
module); instead each submodule with a ``generate`` method that takes ``synced_gpus`` gets an instance-level
wrapper whose default is ``synced_gpus=True`` when there are several ranks. An explicit value is passed through.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn


def _takes_synced_gpus(method) -> bool:
    try:
        return "synced_gpus" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def sync_generate_by_default(model: nn.Module) -> list[str]:
    """Make ``generate`` default to ``synced_gpus=True`` on every submodule that has it; returns their names."""
    wrapped = []
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or "generate" in vars(module) or not _takes_synced_gpus(generate):
            continue
        module.generate = _synced(generate)
        wrapped.append(name)
    return wrapped


def _synced(generate):
    @functools.wraps(generate)
    def generate_in_step(*args, **kwargs):
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True  # stage 3: a rank that is done still joins the others' forward passes
        return generate(*args, **kwargs)

    return generate_in_step
