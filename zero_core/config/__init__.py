"""The ZeRO config: ``ZeroConfig`` (schema.py) and its blocks (blocks.py), built from keyword arguments, a dict or a
DeepSpeed JSON/YAML file (deepspeed.py, files.py), checked field by field (fields.py, errors.py); status.py says what
the engine does with each field and docs.py writes docs/config.md's tables. Nothing here imports a runtime."""

from zero_core.config.blocks import (DEFAULT_LEAF_CLASSES, OFFLOAD_DEVICES, ActivationCheckpointingConfig, AioConfig,
                                     BF16Config, CheckpointConfig, FP16Config, LeafModuleConfig, OffloadOptimizerConfig,
                                     OffloadParamConfig)
from zero_core.config.deepspeed import ALIASES, DEEPSPEED_IGNORED_KEYS, DEPRECATED, RUN_FIELDS, ZERO_SECTION, key_path
from zero_core.config.docs import markdown_tables
from zero_core.config.errors import ZeroConfigError
from zero_core.config.schema import ZeroConfig, field_paths
from zero_core.config.status import BLOCK_FIELD_STATUS, FIELD_STATUS, HONOURED, NOT_YET

__all__ = [
    "ActivationCheckpointingConfig", "AioConfig", "BF16Config", "CheckpointConfig", "FIELD_STATUS", "FP16Config",
    "LeafModuleConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig", "ZeroConfigError",
]
