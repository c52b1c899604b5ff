"""A wrong argument to a public entry point is a TypeError naming the argument, what was given and the fix, raised
where it is given (zero_core/arg_checks.py), not an AttributeError deep inside. No process group is needed: every
check runs before anything distributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_core
from zero_core.tools.estimator import estimate_memory, estimate_stage, model_info


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _message(call) -> str:
    with pytest.raises(TypeError) as caught:
        call()
    return str(caught.value)


def _expect(call, *parts: str) -> None:
    message = _message(call)
    for part in parts:
        assert part in message, f"{part!r} not in: {message}"


def test_init_given_a_config_as_its_first_argument_says_to_pass_config_by_keyword():
    _expect(lambda: zero_core.Init({"stage": 3}), "zero_core.Init", "first argument (module)",
            "got dict {'stage': 3}", "zero_core.Init(config={'stage': 3})")
    _expect(lambda: zero_core.Init("ds_config.json"), "first argument (module)", "got str 'ds_config.json'",
            "config=")


def test_init_given_a_config_as_its_group_or_a_string_dtype_or_a_bad_config():
    _expect(lambda: zero_core.Init(_model(), {"stage": 3}), "data_parallel_group must be a torch.distributed "
            "ProcessGroup or None", "got dict {'stage': 3}", "configuration by keyword (config=...)")
    _expect(lambda: zero_core.Init(dtype="bf16"), "zero_core.Init: dtype", "got str 'bf16'", "torch.bfloat16")
    _expect(lambda: zero_core.Init(config=3), "zero_core.Init: config must be a ZeroConfig, a dict", "got int 3")


def test_setup_given_no_module_names_the_model_argument():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _expect(lambda: zero_core.setup(model.parameters(), optimizer), "zero_core.setup: model must be an nn.Module",
            "got generator", "zero_core.setup(model, optimizer, config)")
    _expect(lambda: zero_core.setup(optimizer, model), "zero_core.setup: model must be an nn.Module", "got SGD",
            "Pass the model first")


def test_setup_given_no_optimizer_says_what_to_pass():
    model = _model()
    _expect(lambda: zero_core.setup(model, torch.optim.AdamW), "zero_core.setup: optimizer must be a "
            "torch.optim.Optimizer", "got the class AdamW", "torch.optim.AdamW(model.parameters(), lr=...)")
    _expect(lambda: zero_core.setup(model, {"stage": 3}), "optimizer must be", "got dict {'stage': 3}",
            "The configuration is the third argument")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _expect(lambda: zero_core.setup(model, [optimizer, "sgd"]), "optimizer[1] must be", "got str 'sgd'")


def test_setup_given_a_config_or_group_of_the_wrong_type():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _expect(lambda: zero_core.setup(model, optimizer, 3), "zero_core.setup: config must be a ZeroConfig, a dict",
            "got int 3", "{'stage': 3}")
    _expect(lambda: zero_core.setup(model, optimizer, {"stage": 2}, "gloo"), "zero_core.setup: process_group",
            "got str 'gloo'", "torch.distributed.new_group")


@pytest.mark.parametrize("groups", [
    lambda m: [[id(p) for p in m.parameters()]],
    lambda m: [{"params": [id(p) for p in m.parameters()], "weight_decay": 0.0}],
])
def test_the_estimator_given_parameter_ids_names_the_entry_and_the_fix(groups):
    model = _model()
    key = "['params']" if isinstance(groups(model)[0], dict) else ""
    for call in (lambda: estimate_stage(model, {"stage": 3}, param_groups=groups(model)),
                 lambda: estimate_memory(model, {"stage": 3}, param_groups=groups(model)),
                 lambda: model_info(model, param_groups=groups(model))):
        _expect(call, f"param_groups[0]{key}[0] must be a parameter", f"got int {id(next(model.parameters()))}",
                "Pass the parameter object itself, not its name or id()")


def test_gathered_parameters_given_a_module_a_name_or_a_number():
    model = _model()
    _expect(lambda: zero_core.GatheredParameters(model), "zero_core.GatheredParameters: params must be parameters",
            "got the module Sequential", "module.parameters()")
    _expect(lambda: zero_core.GatheredParameters(["0.weight"]), "params[0] must be a parameter",
            "got str '0.weight'", "not its name or id()")
    _expect(lambda: zero_core.GatheredParameters(7), "params must be a parameter or an iterable of parameters",
            "got int 7")


@pytest.mark.parametrize("name", ["save_checkpoint", "load_checkpoint", "save_16bit_model", "load_full_state_dict"])
def test_checkpoint_functions_given_a_model_or_a_path_instead_of_the_engine(name, tmp_path):
    function = getattr(zero_core, name)
    _expect(lambda: function(_model(), tmp_path), f"zero_core.{name}: engine must be a zero_core engine",
            "got Sequential", "zero_core.setup(model, optimizer, config) returned", "zero_core.engine_of(model)")
    _expect(lambda: function("ckpt/step-4", _model()), f"zero_core.{name}: engine", "got str 'ckpt/step-4'",
            f"zero_core.{name}(engine, path)")


def test_external_parameters_given_swapped_or_named_arguments():
    model = _model()
    _expect(lambda: zero_core.register_external_parameter(model[0].weight, model), "the arguments are swapped",
            "register_external_parameter(self, self.other.weight)")
    _expect(lambda: zero_core.register_external_parameter(model, "0.weight"), "parameter must be an nn.Parameter",
            "got str '0.weight'", "the parameter object itself")
    _expect(lambda: zero_core.register_external_parameter("0", model[0].weight), "module must be an nn.Module",
            "got str '0'")


@pytest.mark.parametrize("name, extra", [
    ("safe_get_full_fp32_param", ()), ("safe_get_full_grad", ()), ("safe_get_full_optimizer_state", ("exp_avg",)),
    ("safe_set_full_fp32_param", (torch.zeros(2),)), ("safe_set_full_optimizer_state", (torch.zeros(2), "exp_avg")),
])
def test_debug_access_given_a_parameter_name(name, extra):
    _expect(lambda: getattr(zero_core, name)("0.weight", *extra), f"zero_core.{name}: param must be a parameter",
            "got str '0.weight'", "not its name or id()")
