"""Which DCP keys hold what: the model's tensors, each parameter's optimizer state, the optimizer's groups.

Two layouts are recognised, both written from ``torch.distributed.checkpoint.state_dict.get_state_dict``:

- PyTorch's DCP recipe: ``dcp.save({"model": msd, "optim": osd})``, so ``model.<fqn>``,
  ``optim.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``) and ``optim.param_groups.<i>.<hp>`` with
  ``optim.param_groups.<i>.params`` listing the group's parameter names;
- torchtitan's CheckpointManager: the model's keys at the top level (or under ``model.``), the optimizer
  flattened (``flatten_optimizer_state_dict=True``) under ``optimizer.``: ``optimizer.state.<fqn>.<key>`` and
  ``optimizer.param_groups.<fqn>.<hp>`` per parameter; ``train_state``, ``lr_scheduler`` and ``dataloader``
  entries are not model state and are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zero_core.checkpoint.format import CheckpointError

OPTIMIZER_PREFIXES = ("optim.", "optimizer.")
MODEL_PREFIX = "model."
# torchtitan's other top-level states: the trainer's, not the model's or the optimizer's
OTHER_STATE = ("train_state.", "lr_scheduler.", "dataloader.")


@dataclass
class DCPLayout:
    model: dict[str, str] = field(default_factory=dict)            # parameter/buffer name -> key
    state: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> optimizer state key -> DCP key
    groups: list[dict[str, str]] = field(default_factory=list)  # nested groups: hyper-parameter -> key
    per_param_hyperparameters: dict[str, dict[str, str]] = field(default_factory=dict)  # flattened: name -> hp -> key
    params_keys: list[str] = field(default_factory=list)  # nested groups: the key listing each group's names


def read_layout(keys: dict[str, bool], model_names: Optional[set] = None) -> DCPLayout:
    """``keys``: every DCP key -> whether it holds a tensor. ``model_names``, when known, settles whether a
    leading ``model.`` is DCP's wrapper key or part of the model's own names."""
    optimizer_prefix = next((p for p in OPTIMIZER_PREFIXES
                             if any(k.startswith((p + "state.", p + "param_groups.")) for k in keys)), None)
    rest = [k for k in keys
            if not (optimizer_prefix and k.startswith(optimizer_prefix)) and not k.startswith(OTHER_STATE)]
    strip = _model_prefix(rest, model_names)
    layout = DCPLayout()
    for key in rest:
        if not keys[key]:
            raise CheckpointError(f"the DCP entry '{key}' is not a tensor (a bytes entry: pickled Python data) in "
                                  "the model's state; only tensors can be loaded into the model")
        layout.model[key[len(strip):]] = key
    if optimizer_prefix is not None:
        _optimizer(layout, [k for k in keys if k.startswith(optimizer_prefix)], optimizer_prefix, keys)
    return layout


def _model_prefix(keys: list[str], model_names: Optional[set]) -> str:
    if not keys or not all(k.startswith(MODEL_PREFIX) for k in keys):
        return ""
    if model_names is not None and set(keys) <= set(model_names):
        return ""  # the model's own top-level module is called "model" (Hugging Face's *ForCausalLM)
    return MODEL_PREFIX


def _optimizer(layout: DCPLayout, keys: list[str], prefix: str, is_tensor: dict[str, bool]) -> None:
    names = set(layout.model)
    state, groups = prefix + "state.", prefix + "param_groups."
    nested: dict[int, dict[str, str]] = {}
    for key in keys:
        if key.startswith(state):
            name, _, state_key = key[len(state):].rpartition(".")
            _known(name, names, key)
            layout.state.setdefault(name, {})[state_key] = key
            continue
        if not key.startswith(groups):
            raise CheckpointError(f"the DCP entry '{key}' is neither optimizer state ('{state}<name>.<key>') nor "
                                  f"a parameter group ('{groups}...'): this optimizer layout is not supported")
        head, _, hyperparameter = key[len(groups):].rpartition(".")
        if head.isdigit() and head not in names:  # get_state_dict's nested groups: param_groups.<i>.<hp>
            nested.setdefault(int(head), {})[hyperparameter] = key
        else:  # flatten_optimizer_state_dict: param_groups.<fqn>.<hp>, one copy per parameter
            _known(head, names, key)
            layout.per_param_hyperparameters.setdefault(head, {})[hyperparameter] = key
    for index in sorted(nested):
        entries = nested[index]
        if "params" not in entries:
            raise CheckpointError(f"the DCP optimizer group '{groups}{index}' has no 'params' entry naming its "
                                  "parameters: the group cannot be matched to the model")
        layout.params_keys.append(entries.pop("params"))
        layout.groups.append(entries)


def _known(name: str, names: set, key: str) -> None:
    if name not in names:
        raise CheckpointError(f"the DCP optimizer entry '{key}' belongs to '{name}', which is not a model "
                              "parameter of the checkpoint")
