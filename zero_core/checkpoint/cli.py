"""``zero-checkpoint``: consolidate, inspect and export sharded checkpoints, without a process group.

    zero-checkpoint consolidate CKPT OUT --dtype bf16 --max-shard-size 5GB [--hf_config MODEL_DIR/config.json]
                                [--weights_ema true]   (the moving average of the weights: weights_ema_decay)
    zero-checkpoint inspect CKPT [--verify true] [--tensors true]
    zero-checkpoint export-optimizer CKPT OUT.pt
    zero-checkpoint gather NODE_DIR... --out CKPT      (node-local checkpoints: checkpoint.use_node_local_storage)
    zero-checkpoint convert SRC DST --to dcp|deepspeed|zero   (ours -> DCP or a DeepSpeed universal checkpoint;
                                                              a DCP or DeepSpeed checkpoint -> ours)
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Literal, Optional

from jsonargparse import auto_cli


def consolidate(checkpoint: str, out: str, dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
                max_shard_size: str = "5GB", verify: bool = True, progress: bool = True,
                hf_config: Optional[str] = None, weights_ema: bool = False) -> None:
    """Write the checkpoint's model as Hugging Face-style sharded safetensors plus model.safetensors.index.json.

    Args:
        checkpoint: Checkpoint directory written by save_checkpoint.
        out: Output directory (created; an earlier consolidation there is replaced once the new one is complete).
        dtype: Dtype of floating tensors in the output.
        max_shard_size: Largest output file, e.g. 500MB, 5GB, 2GiB.
        verify: Check every checkpoint file's SHA-256 first.
        progress: Show a progress bar.
        hf_config: The model's Hugging Face config.json (or its directory): written into OUT naming --dtype, so
            from_pretrained loads the weights in the dtype they were written in.
        weights_ema: Write the moving average of the weights that the checkpoint holds (trained with
            zero_optimization.weights_ema_decay) instead of the trained weights.
    """
    from zero_core.checkpoint.consolidate import consolidate as run

    out_dir = run(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size, verify=verify, progress=progress,
                  hf_config=hf_config, weights_ema=weights_ema)
    print(f"wrote {out_dir}")


def inspect(checkpoint: str, verify: bool = False, tensors: bool = False) -> None:
    """Print what a checkpoint holds: run, files, parameters, optimizer, loss scaler, client state.

    Args:
        checkpoint: Checkpoint directory.
        verify: Also check every file's size and SHA-256 against the manifest.
        tensors: List every tensor with its shape, dtype and where its fragments are.
    """
    from zero_core.checkpoint.summary import describe

    print(describe(checkpoint, verify=verify, tensors=tensors))


def export_optimizer(checkpoint: str, out: str, verify: bool = True) -> None:
    """Write the optimizer state as a plain torch optimizer.state_dict() file, e.g. for a DDP resume.

    Args:
        checkpoint: Checkpoint directory.
        out: Output file, loadable with torch.load(out, weights_only=True).
        verify: Check every checkpoint file's SHA-256 first.
    """
    from zero_core.checkpoint.consolidate import export_optimizer_state

    print(f"wrote {export_optimizer_state(checkpoint, out, verify=verify)}")


def convert(src: str, dst: str, *, to: Literal["dcp", "deepspeed", "zero"],
            layout: Literal["fsdp2", "torchtitan"] = "fsdp2", optimizer_class: Optional[str] = None,
            verify: bool = True, progress: bool = True) -> None:
    """Convert between our checkpoints and other libraries' formats, one tensor at a time, without a process group.

    Args:
        src: The checkpoint to convert: one of ours (for --to dcp or deepspeed), or another library's (--to zero):
            a DCP directory (FSDP2, torchtitan) or a DeepSpeed one (with 'latest', or a tag folder).
        dst: Output directory (appears only when complete).
        to: dcp: a DCP directory that dcp.load reads into an FSDP2 model and optimizer; deepspeed: a DeepSpeed
            universal checkpoint (resume it with "checkpoint": {"load_universal": true}); zero: our sharded
            format, as if saved by one rank (it loads at any world size and stage).
        layout: --to dcp: fsdp2 ({"model", "optim"} of get_state_dict) or torchtitan (model keys at the top
            level, the optimizer flattened under "optimizer").
        optimizer_class: --to zero: the optimizer's class, e.g. torch.optim.adamw.AdamW, when it cannot be
            inferred from the saved state.
        verify: --to dcp or deepspeed: check every file's SHA-256 first.
        progress: Show a progress bar.
    """
    from zero_core.checkpoint.convert import convert as run

    options = {"layout": layout, "verify": verify} if to == "dcp" else {"verify": verify} if to == "deepspeed" else {}
    if to == "zero" and optimizer_class is not None:
        options["optimizer_class"] = optimizer_class
    print(f"wrote {run(src, dst, to, progress=progress, **options)}")


def gather(args: list[str]) -> None:
    """``gather NODE_DIR... --out DIR`` (argparse: jsonargparse has no positional list of paths)."""
    parser = argparse.ArgumentParser(
        prog="zero-checkpoint gather",
        description="Join the directories a node-local save (checkpoint.use_node_local_storage) wrote on each "
                    "node, copied to one machine, into one checkpoint directory that reshards and consolidates "
                    "like any other.")
    parser.add_argument("node_dirs", nargs="+", help="every node's checkpoint directory, in any order")
    parser.add_argument("--out", required=True, help="the checkpoint directory to write (replaced atomically)")
    parser.add_argument("--verify", choices=("true", "false"), default="true",
                        help="check every file's SHA-256 against its node's manifest first (default true)")
    options = parser.parse_args(args)
    from zero_core.checkpoint.node_local import gather as run

    print(f"wrote {run(options.node_dirs, options.out, verify=options.verify == 'true')}")


def _underscored(args: list[str]) -> list[str]:
    """Accept ``--max-shard-size`` as well as jsonargparse's own ``--max_shard_size``."""
    return [re.sub(r"^--[a-z0-9-]+", lambda m: m.group(0)[:2] + m.group(0)[2:].replace("-", "_"), a) for a in args]


def main(args: Optional[list[str]] = None) -> None:
    from zero_core.checkpoint.format import CheckpointError

    args = _underscored(sys.argv[1:] if args is None else list(args))
    try:
        if args[:1] == ["gather"]:
            gather(args[1:])
            return
        try:
            auto_cli({"consolidate": consolidate, "inspect": inspect, "export-optimizer": export_optimizer,
                      "convert": convert}, args=args)
        except SystemExit:
            if args[:1] in (["-h"], ["--help"]):  # gather is argparse's, outside jsonargparse's subcommands
                print("\n  also: gather NODE_DIR... --out CKPT   Join node-local checkpoint directories into one "
                      "(zero-checkpoint gather --help).")
            raise
    except (CheckpointError, FileNotFoundError) as error:  # a bad checkpoint is the user's news, not a bug
        sys.exit(f"zero-checkpoint: error: {error}")


if __name__ == "__main__":
    main()
