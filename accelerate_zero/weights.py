"""Whole-model weights out of a ZeRO engine: ``get_state_dict`` and ``save_model``."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Union

import torch
import torch.distributed as dist

import zero_core

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"


def full_state_dict(engine: zero_core.ZeroEngine) -> dict[str, torch.Tensor]:
    """The model's whole state dict. Stages 1/2: on every rank (parameters are whole everywhere). Stage 3: on
    rank 0 as CPU copies, gathered one unit at a time; other ranks get ``{}``. A collective."""
    if engine.config.stage < 3:
        return engine.module.state_dict()
    return engine.full_state_dict(rank0_only=True, masters=False)  # the live (training dtype) values


def save_model(engine: zero_core.ZeroEngine, save_directory: Union[str, os.PathLike], max_shard_size) -> None:
    """Write the live weights as safetensors into ``save_directory``, as ``Accelerator.save_model`` lays them
    out: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus an index when larger than
    ``max_shard_size``. Streams through ``zero_core.checkpoint.save_16bit_model``; a collective."""
    if engine.config.stage == 3 and not engine.config.gather_16bit_weights_on_model_save:
        raise ValueError(
            "save_model at ZeRO stage 3 gathers the partitioned weights, which DeepSpeed's setting "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save: true allows; set it in the ZeRO config "
            "(zero.yaml), or use accelerator.save_state and consolidate the checkpoint offline"
        )
    target = Path(save_directory).absolute()
    token = _shared_token(engine)
    staging = target / f".zero-save-{token}"
    leader = engine.topology.rank == 0
    if leader:
        target.mkdir(parents=True, exist_ok=True)
    zero_core.save_16bit_model(engine, staging, max_shard_size=max_shard_size)
    if leader:
        _publish_weights(staging, target)
    _barrier(engine)


def _publish_weights(staging: Path, target: Path) -> None:
    """Move the files into ``target``; one shard becomes ``model.safetensors`` and needs no index."""
    for old in list(target.glob("model-*-of-*.safetensors")) + [target / SAFE_WEIGHTS_NAME, target / SAFE_INDEX_NAME]:
        if old.is_file():
            old.unlink()  # an earlier save's files, or they would mix with this one's
    shards = sorted(staging.glob("model-*-of-*.safetensors"))
    if len(shards) == 1:
        os.replace(shards[0], target / SAFE_WEIGHTS_NAME)
    else:
        for item in shards + [staging / SAFE_INDEX_NAME]:
            os.replace(item, target / item.name)
    shutil.rmtree(staging)


def _shared_token(engine: zero_core.ZeroEngine) -> str:
    """A name every rank agrees on (rank 0's random token, broadcast as a number: nothing pickled)."""
    token = torch.tensor([secrets.randbits(48)], dtype=torch.int64, device=engine.device)
    topology = engine.topology
    if topology.world_size > 1:
        dist.broadcast(token, src=topology.global_rank(0), group=topology.group)
    return f"{int(token):012x}"


def _barrier(engine: zero_core.ZeroEngine) -> None:
    if engine.topology.world_size > 1:
        dist.barrier(group=engine.topology.group)
