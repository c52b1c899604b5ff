"""Sharded checkpoints for the ZeRO engine: atomic save, verified and resharding load, streaming consolidation.

    save_checkpoint(engine, path, client_state)        every rank; a directory appears at path when complete
                                                       (exclude_frozen_parameters=True: without the base model)
    client_state = load_checkpoint(engine, path)       every rank; any world size and stage
    consolidate(path, out, dtype="bf16")               offline: Hugging Face-style safetensors shards + index
    gather_node_dirs(node_dirs, out)                   offline: join a node-local save's node directories
    save_16bit_model(engine, out_dir)                  every rank: the live weights, streamed

docs/checkpoints.md is the user's guide; docs/checkpoint-format.md describes the files.
"""

from zero_core.checkpoint.consolidate import (
    consolidate, consolidated_state_dict, export_optimizer_state, read_optimizer_states,
)
from zero_core.checkpoint.export16 import save_16bit_model
from zero_core.checkpoint.files import atomic_directory, atomic_file
from zero_core.checkpoint.hf_config import write_config as write_hf_config
from zero_core.checkpoint.format import MANIFEST as MANIFEST_FILE, CheckpointError, CheckpointMismatchError, read_manifest
from zero_core.checkpoint.latest import checkpoint_problem, has_optimizer_state, is_checkpoint, latest_checkpoint
from zero_core.checkpoint.load import load_checkpoint, load_full_state_dict
from zero_core.checkpoint.node_local import gather as gather_node_dirs
from zero_core.checkpoint.save import save_checkpoint
from zero_core.checkpoint.summary import describe
from zero_core.checkpoint.values import load_client_state

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "MANIFEST_FILE",
    "atomic_directory",
    "atomic_file",
    "checkpoint_problem",
    "consolidate",
    "consolidated_state_dict",
    "describe",
    "export_optimizer_state",
    "gather_node_dirs",
    "write_hf_config",
    "is_checkpoint",
    "has_optimizer_state",
    "read_optimizer_states",
    "latest_checkpoint",
    "load_checkpoint",
    "load_client_state",
    "load_full_state_dict",
    "read_manifest",
    "save_16bit_model",
    "save_checkpoint",
]
