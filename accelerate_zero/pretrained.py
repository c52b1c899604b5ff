"""``from_pretrained`` in an unmodified script builds the model partitioned at stage 3 (``--swap-accelerator``).

DeepSpeed users get this from ``HfDeepSpeedConfig``: once it exists, transformers builds every model under
``deepspeed.zero.Init``. Under the swap the script knows nothing of ZeRO, so at stage 3 the swap wraps
``PreTrainedModel.from_pretrained`` to run inside ``zero_core.Init`` with the launch's config: each rank then
reads only its own slices of the weight files (zero_core/pretrained/) and the model is never whole on any rank.
The process group is created first, as the Accelerator would create it (Accelerate's ``PartialState``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

import zero_core

from .plugin import ZeroPlugin


def install_if_stage3(plugin: ZeroPlugin) -> bool:
    """Wrap ``from_pretrained`` when the launch's stage is 3 and transformers is installed."""
    if plugin.config.stage != 3 or importlib.util.find_spec("transformers") is None:
        return False
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        # on the run's device, as deepspeed.zero.Init: the Trainer's model.to(device) then moves nothing
        with torch.device(_process_group_device()), zero_core.Init(config=plugin.config):
            return original(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    return True


def _process_group_device() -> torch.device:
    """Create the process group as the Accelerator will (Accelerate's ``PartialState``) and return its device."""
    from accelerate import PartialState

    from .accelerator import _cpu_only_multiprocess

    # the same choice ZeroAccelerator makes (gloo on CPU for torchrun workers without GPUs), so they agree
    state = PartialState(cpu=True) if _cpu_only_multiprocess() else PartialState()
    return state.device
