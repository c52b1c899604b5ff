"""zero_core: the shared ZeRO engine under lightning_zero and accelerate_zero.

    engine = zero_core.setup(model, optimizer, config)

See docs/core-api.md for the engine and docs/config.md for every configuration field.
"""

from zero_core.checkpoint import (
    CheckpointError,
    consolidate,
    latest_checkpoint,
    load_checkpoint,
    load_full_state_dict,
    save_16bit_model,
    save_checkpoint,
)
from zero_core.comm.guard import CollectiveMismatchError
from zero_core.config import ZeroConfig, ZeroConfigError
from zero_core.stage3.debug_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from zero_core.engine import ZeroEngine, setup
from zero_core.stage3.external_params import GatheredParameters, register_external_parameter, unregister_external_parameter
from zero_core.fragments import Fragment
from zero_core.stage3.init_context import Init
from zero_core.layout import FlatLayout, Range, compute_layout
from zero_core.stage3.leaf_modules import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module

__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "consolidate",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "save_16bit_model",
    "save_checkpoint",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "setup",
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unregister_external_parameter",
    "Fragment",
    "FlatLayout",
    "Range",
    "compute_layout",
    "get_z3_leaf_modules",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]
