"""``from_pretrained`` while ``zero_core.Init`` is open: each rank reads only its own slices.

transformers 5 builds a model on the meta device, then fills it in ``PreTrainedModel._load_pretrained_model``, a
static method that reads every tensor whole on every rank (with DeepSpeed, transformers itself switches to a
ZeRO-3 path, ``HfDeepSpeedConfig``; there is no such switch for other engines). So while an ``Init`` is open, and
only then, that one method is ours: for the models it covers, the weights go straight into the shards
(into_shards.fill: one tensor's rows at a time) and transformers finishes as usual (missing keys initialised,
tied weights tied, the loading report). Anything it does not cover (a state_dict passed in, quantisation, a
device_map, a weight converter that fuses or splits tensors) goes to transformers' own loader, and Init
partitions what it loads when the context closes. Nothing of transformers is changed outside the context.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

METHOD = "_load_pretrained_model"


@dataclass
class Installed:
    owner: type
    original: Any  # the staticmethod object found on the class


def install(init) -> Optional[Installed]:
    """Route ``from_pretrained``'s weight loading through ``init`` while it is open (when transformers is in use)."""
    if "transformers" not in sys.modules:  # never import it for a model that does not use it
        return None
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return None
    original = PreTrainedModel.__dict__.get(METHOD)
    if not isinstance(original, staticmethod):  # a transformers this hook does not know: its own loader runs
        return None
    setattr(PreTrainedModel, METHOD, staticmethod(_loader(init, original.__func__)))
    return Installed(PreTrainedModel, original)


def uninstall(installed: Optional[Installed]) -> None:
    if installed is not None:
        setattr(installed.owner, METHOD, installed.original)


def _loader(init, original: Callable) -> Callable:
    def load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
        if not _covered(model, state_dict, checkpoint_files, load_config):
            return original(model, state_dict, checkpoint_files, load_config, expected_keys)
        return _load_into_shards(init, model, checkpoint_files, load_config, original,
                                 (model, state_dict, checkpoint_files, load_config, expected_keys))

    return load_pretrained_model


def _covered(model, state_dict, checkpoint_files, load_config) -> bool:
    device_map = load_config.device_map
    plain_device_map = device_map is None or all(str(d) in ("cpu", "meta") for d in device_map.values())
    return (state_dict is None and bool(checkpoint_files) and load_config.hf_quantizer is None
            and plain_device_map and getattr(load_config, "device_mesh", None) is None
            and all(p.is_meta or _partitioned(p) for p in model.parameters()))


def _partitioned(param) -> bool:
    from zero_core import registry

    return registry.pending_partition_of(param) is not None


def _load_into_shards(init, model, checkpoint_files, load_config, original, call: tuple):
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    from zero_core.pretrained.files import WeightFiles
    from zero_core.pretrained.into_shards import fill, plan

    model_keys = model.state_dict()  # meta tensors and partitioned views: names and shapes, no values
    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix

    with WeightFiles([Path(f) for f in checkpoint_files]) as files:
        renamed = {}
        for key in files.info:
            new, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
            if new not in model_keys and key in model_keys:
                new, pattern = rename_source_key(key, [], [], prefix, model_keys)
            if pattern is not None:  # a converter fuses or splits tensors: transformers' own loader does that
                files.close()
                return original(*call)
            renamed[key] = new
        targets, missing, unexpected = plan(model, files, renamed.__getitem__)
        mismatched = {(t.keys[0], files.info[t.file_key].shape, tuple(t.tensor.shape)) for t in targets
                      if tuple(files.info[t.file_key].shape) != tuple(t.tensor.shape)}
        wrong = {key for key, _, _ in mismatched}
        fill(model, [t for t in targets if t.keys[0] not in wrong], files, init, _dtype_of(load_config),
             init.rank0_reads, after_set=_mark_initialised)
    # transformers keeps mismatched keys apart from missing ones, and initialises both afterwards
    info = LoadStateDictInfo(missing_keys=set(missing), unexpected_keys={renamed[k] for k in unexpected},
                             mismatched_keys=mismatched, error_msgs=[], conversion_errors={},
                             skipped_pp_keys=set())
    return info, None


def _dtype_of(load_config) -> Callable:
    """As transformers decides: the dtype the meta tensor was built with, or its keep-in-fp32 plan's."""
    plan = load_config.dtype_plan or {}
    if not plan:
        return lambda key, tensor: tensor.dtype
    from transformers.core_model_loading import build_glob_alternation

    pattern, group_of, _ = build_glob_alternation(list(plan.keys()))

    def dtype_of(key: str, tensor: torch.Tensor) -> torch.dtype:
        found = pattern.search(key)
        return plan[group_of[found.lastgroup]] if found is not None else tensor.dtype

    return dtype_of


def _mark_initialised(tensor: torch.Tensor) -> None:
    tensor._is_hf_initialized = True  # transformers' own mark: its weight init then leaves the tensor alone
