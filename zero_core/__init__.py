"""zero_core: the shared ZeRO engine under lightning_zero and accelerate_zero.

    engine = zero_core.setup(model, optimizer, config)

See docs/core-api.md for the engine and docs/config.md for every configuration field. ``__all__`` is the
public surface: the front-ends (lightning_zero, accelerate_zero) import nothing else of the core
(tests/core/test_public_surface.py checks it); docs/core-api.md, "The public surface", lists what it is for.
"""

from zero_core.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    atomic_directory,
    atomic_file,
    checkpoint_problem,
    consolidate,
    consolidated_state_dict,
    export_optimizer_state,
    has_optimizer_state,
    is_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_client_state,
    load_full_state_dict,
    read_optimizer_states,
    save_16bit_model,
    save_checkpoint,
    write_hf_config,
)
from zero_core.comm.errors import CollectiveMismatchError, StoreMessageError
from zero_core.comm.restarts import accumulation_for, attempt_store, init_process_group_for_attempt, restart_attempt
from zero_core.config import ZeroConfig, ZeroConfigError
from zero_core.stage3.debug_access import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from zero_core.engine import ZeroEngine, setup
from zero_core.stage3.generation import generation
from zero_core.stage3.external_params import GatheredParameters, register_external_parameter, unregister_external_parameter
from zero_core.fragments import Fragment
from zero_core.stage3.init_context import Init
from zero_core.stage3.partitioned_param import is_released
from zero_core.stage3.save_pretrained_check import install_if_loaded as install_save_pretrained_check
from zero_core.pretrained.into_shards import load_pretrained
from zero_core.layout import FlatLayout, Range, compute_layout
from zero_core.stage3.leaf_modules import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from zero_core.optim.mixed_precision import cast_floating_inputs
from zero_core.optim.sharded_optimizer import ShardedOptimizer
from zero_core.registry import engine_of, is_partitioned
from zero_core.tiling import TiledLinear, TiledLinearReturnBias
from zero_core import checkpointing

__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "StoreMessageError",
    "consolidate",
    "latest_checkpoint",
    "accumulation_for",
    "attempt_store",
    "init_process_group_for_attempt",
    "restart_attempt",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "save_16bit_model",
    "save_checkpoint",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "setup",
    "generation",
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
    "TiledLinear",
    "TiledLinearReturnBias",
    "checkpointing",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    # the surface the front-ends build on (docs/core-api.md, "The public surface")
    "engine_of",
    "is_partitioned",
    "is_released",
    "install_save_pretrained_check",
    "ShardedOptimizer",
    "cast_floating_inputs",
    "MANIFEST_FILE",
    "is_checkpoint",
    "has_optimizer_state",
    "checkpoint_problem",
    "load_client_state",
    "consolidated_state_dict",
    "read_optimizer_states",
    "export_optimizer_state",
    "atomic_directory",
    "atomic_file",
    "write_hf_config",
]
