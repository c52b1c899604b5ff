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
from pathlib import Path
from typing import Literal, Union

import torch

import zero_core

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
    checkpoint = dict(zero_core.load_client_state(source) or {})
    # tied weights repeated under each name, as state_dict() has them
    checkpoint["state_dict"] = zero_core.consolidated_state_dict(source, dtype=dtype, tied_weights=True)
    if optimizer:
        checkpoint["optimizer_states"] = zero_core.read_optimizer_states(source)  # one per optimizer
    out.parent.mkdir(parents=True, exist_ok=True)
    with zero_core.atomic_file(out) as partial:  # never a half-written file at ``out``
        torch.save(checkpoint, partial)
    return out


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
