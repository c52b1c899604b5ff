"""``save_16bit_model``: the live model's weights, as trained (16-bit under fp16/bf16), in Hugging Face-style
safetensors shards, written during training.

Every rank walks ``engine.iter_full_params()`` in lockstep (in stage 3 each parameter is gathered for that
moment only); rank 0 keeps one output shard at a time. No rank ever holds the whole model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Union

import torch

from zero_core.arg_checks import check_engine
from zero_core.contracts import CheckpointedEngine
from zero_core.checkpoint.collective import on_first_replica, run_agreed, shared_token, staged_together
from zero_core.checkpoint.consolidate import DTYPES, DtypeName
from zero_core.checkpoint.files import StagedDirectory
from zero_core.checkpoint.format import PathLike
from zero_core.checkpoint.hf_config import ConfigSource, DtypeTally, dtype_name, write_config
from zero_core.checkpoint.hf_shards import INDEX, ShardedWriter, parse_size
from zero_core.checkpoint.model_info import non_persistent_buffers, tied_aliases


def save_16bit_model(engine: CheckpointedEngine, out_dir: PathLike, dtype: Optional[DtypeName] = None,
                     max_shard_size: Union[int, str] = "5GB", exclude_frozen_parameters: bool = False,
                     hf_config: Optional[ConfigSource] = None) -> bool:
    """Save the model's weights to ``out_dir`` (sharded safetensors + index). A collective; returns whether saved.

    ``dtype`` None keeps each tensor's dtype (the training dtype); "fp32", "bf16" or "fp16" casts floating
    tensors. ``hf_config`` (a Hugging Face config.json, its directory, or a dict): written beside the weights
    naming the dtype written, so ``from_pretrained`` loads them as they are. In stage 3 this needs
    ``gather_16bit_weights_on_model_save`` in the config, as in DeepSpeed.
    """
    check_engine(engine, "zero_core.save_16bit_model")
    if engine.config.stage == 3 and not engine.config.gather_16bit_weights_on_model_save:
        warnings.warn("save_16bit_model did nothing: stage 3 needs zero_optimization."
                      "stage3_gather_16bit_weights_on_model_save=true to gather the weights; or save a "
                      "checkpoint and run `zero-checkpoint consolidate`", stacklevel=2)
        return False
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be None or one of {sorted(DTYPES)}, got {dtype!r}")
    on_first_replica(engine, _save, engine, Path(out_dir).absolute(), dtype, max_shard_size,
                     exclude_frozen_parameters, hf_config)  # MiCS: replicas hold the same weights
    return True


def _save(engine, out: Path, dtype, max_shard_size, exclude_frozen_parameters: bool, hf_config) -> None:
    leader = engine.topology.rank == 0
    staged = StagedDirectory(out, shared_token(engine), marker=INDEX)
    with staged_together(engine, staged, leader) as temp:
        writer = ShardedWriter(temp, parse_size(max_shard_size)) if leader else None
        written = run_agreed(engine, _stream, engine, writer, DTYPES.get(dtype), exclude_frozen_parameters)
        run_agreed(engine, _finish, engine, writer, staged, dtype, written, hf_config, temp)


def _stream(engine, writer: Optional[ShardedWriter], dtype: Optional[torch.dtype],
            exclude_frozen: bool) -> Optional[torch.dtype]:
    """Write every parameter (and buffer); returns the dtype of the floating parameters written (rank 0)."""
    # Every rank must finish the generator (in stage 3 each step is a collective gather), so a write error on
    # rank 0 is kept until the walk is over, then raised and agreed on.
    written, error, tally = set(), None, DtypeTally()
    for name, param in engine.iter_full_params():
        written.add(name)
        if writer is None or error is not None or (exclude_frozen and not param.requires_grad):
            continue
        try:
            tensor = _converted(param, dtype)
            writer.add(name, tensor)
            tally.add(tensor)
        except Exception as caught:
            error = caught
    if error is not None:
        raise error
    if writer is not None:
        skip = non_persistent_buffers(engine.module)  # buffers are whole on every rank, in every stage
        for name, tensor in engine.module.named_buffers():
            if name not in written and name not in skip:
                writer.add(name, _converted(tensor, dtype))
    return tally.most()


def _converted(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A CPU copy (stage 3 frees the gathered storage once the generator moves on)."""
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target, copy=True)


def _finish(engine, writer: Optional[ShardedWriter], staged: StagedDirectory, dtype: Optional[str],
            written: Optional[torch.dtype], hf_config, temp: Path) -> None:
    if writer is not None:
        label = dtype or (dtype_name(written) if written is not None else "as trained")
        writer.finish({"dtype": label, "tied_weights": tied_aliases(engine.module)})
        if hf_config is not None and written is not None:
            write_config(hf_config, temp, written)
        staged.publish()
