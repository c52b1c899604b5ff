"""Turn a ZeroStrategy checkpoint directory into one ordinary Lightning checkpoint file.

    python -m lightning_zero.convert checkpoints/epoch=1-step=100.ckpt model.ckpt

The file has what a DDP run writes: ``state_dict`` (fp32 master weights, tied weights under every name),
``optimizer_states`` (a plain ``optimizer.state_dict()`` per optimizer) and the Lightning state saved beside the shards (loops,
callbacks, schedulers, hyper-parameters). So ``MyModule.load_from_checkpoint(file)`` works, and so does
``Trainer(strategy="ddp").fit(model, ckpt_path=file)``. No process group is needed; the whole model and
optimizer state are held in memory once.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
from pathlib import Path
from typing import Literal, Union

import torch
from safetensors.torch import load_file

import zero_core.checkpoint as zero_checkpoint
from zero_core.checkpoint import load_client_state

from .checkpoint_io import is_sharded_checkpoint, missing_checkpoint_error

PathLike = Union[str, "os.PathLike[str]"]


def convert_to_single_file(checkpoint_dir: PathLike, output_file: PathLike,
                           dtype: Literal["fp32", "bf16", "fp16"] = "fp32", optimizer: bool = True) -> Path:
    """Write ``checkpoint_dir`` (a sharded ZeroStrategy checkpoint) as the single Lightning file ``output_file``.

    ``dtype`` casts the weights (the optimizer state stays fp32); ``optimizer=False`` leaves the optimizer state
    out (a smaller file for inference; a DDP resume then needs it).
    """
    source, out = Path(checkpoint_dir), Path(output_file)
    if not is_sharded_checkpoint(source):
        raise missing_checkpoint_error(source)
    checkpoint = dict(load_client_state(source) or {})
    scratch = out.parent / f".{out.name}.convert-{secrets.token_hex(6)}"
    scratch.mkdir(parents=True)
    try:
        checkpoint["state_dict"] = _model_state(source, scratch / "model", dtype)
        if optimizer:
            state = torch.load(zero_checkpoint.export_optimizer_state(source, scratch / "optimizer.pt"),
                               weights_only=True)
            checkpoint["optimizer_states"] = state if isinstance(state, list) else [state]  # one per optimizer
        partial = scratch / "checkpoint.ckpt"
        torch.save(checkpoint, partial)
        os.replace(partial, out)  # never a half-written file at ``out``
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _model_state(source: Path, scratch: Path, dtype: str) -> dict[str, torch.Tensor]:
    """Consolidated weights and buffers, with tied weights repeated under each name as state_dict() has them."""
    zero_checkpoint.consolidate(source, scratch, dtype=dtype, progress=False)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(scratch.glob("*.safetensors")):
        state.update(load_file(file))
    for alias, canonical in zero_checkpoint.read_manifest(source).get("aliases", {}).items():
        state[alias] = state[canonical]
    return state


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="a checkpoint directory written under ZeroStrategy")
    parser.add_argument("output_file", help="the single .ckpt file to write")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights dtype")
    parser.add_argument("--no-optimizer", action="store_true", help="leave the optimizer state out")
    args = parser.parse_args(argv)
    out = convert_to_single_file(args.checkpoint_dir, args.output_file, args.dtype, optimizer=not args.no_optimizer)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
