"""``zero-estimate``: per-rank memory of each ZeRO stage, from a parameter count or a model built on meta.

    zero-estimate --num-params 7.5e9 --world-size 64              # the ZeRO paper's table (mixed precision)
    zero-estimate --model benchmarks.gpt:build_gpt --world-size 8 --config zero.yaml --precision bf16
    zero-estimate --model my.models:build --param-groups my.models:decay_groups --world-size 2

docs/estimator.md explains the formulas.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Optional

from jsonargparse import ArgumentParser

from zero_core.config import ZeroConfig
from zero_core.planning import flat_bucket_numel, step_tile_numel
from zero_core.tools.estimator import PRECISIONS, STAGES, UNITS, _fmt, estimate_memory, format_table, model_info


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="zero-estimate",
        description="Predict per-rank bytes (parameters, gradients, fp32 master, optimizer state, buffers, "
        "stage 3 live parameters) for ZeRO stages 0-3 on a number of data-parallel ranks.",
    )
    parser.add_argument("--num-params", type=Optional[float], default=None,
                        help="Trainable parameter count Ψ (e.g. 7.5e9); give this or --model.")
    parser.add_argument("--model", type=Optional[str], default=None,
                        help="'module:factory': a callable returning an nn.Module, built on the meta device "
                        "(nothing is allocated); padding then follows the engine's flat layout exactly.")
    parser.add_argument("--param-groups", type=Optional[str], default=None,
                        help="'module:function': called with the (meta) model, returns the optimizer's parameter "
                        "groups (dicts with 'params', or an optimizer); the engine plans one flat buffer per group "
                        "and dtype, so a split (e.g. AdamW decay / no-decay) changes padding and buffers. "
                        "Default: one group.")
    parser.add_argument("--world-size", type=int, nargs="+", default=[1],
                        help="Data-parallel ranks N; several values print one table each (e.g. 8 64).")
    parser.add_argument("--config", type=Optional[str], default=None,
                        help="A ZeRO config file (.json/.yaml; a zero_optimization block or a whole DeepSpeed "
                        "config): bucket sizes, max_live_parameters and the precision are read from it.")
    parser.add_argument("--precision", type=Optional[str], default=None,
                        help=f"One of {', '.join(PRECISIONS)}. Default: the config's (fp16/bf16 when enabled); "
                        "without --config, fp16 mixed precision as in the ZeRO paper.")
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="Stages to show (0 = plain DDP).")
    parser.add_argument("--optimizer-state-bytes", type=int, default=8,
                        help="Optimizer-state bytes per element besides the fp32 master (Adam: 8; SGD with "
                        "momentum: 4).")
    parser.add_argument("--unit", type=str, default="GB", help=f"One of {', '.join(UNITS)} (GB = 1e9 bytes).")
    parser.add_argument("--device", type=str, default="cuda", choices=["cuda", "cpu"],
                        help="Where the engine holds the parameters: on cuda, flat layouts put parameter starts and "
                        "shard boundaries on multiples of 64 elements unless the config sets shard_alignment "
                        "(cpu: packed). Default: cuda.")
    return parser


def load_factory(spec: str, flag: str = "--model") -> Callable:
    """The callable named by 'package.module:attribute', importable from the current directory or installed."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{flag} must look like 'package.module:factory', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a console script does not see the current directory by itself
    module = importlib.import_module(module_name)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"{flag} {spec!r}: {module_name} has no callable named {attribute!r}")
    return factory


def build_on_meta(spec: str):
    """Call the factory with torch's default device set to meta, so parameters have shapes but no storage."""
    import torch

    with torch.device("meta"):
        model = load_factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {spec!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _subject(args):
    if (args.num_params is None) == (args.model is None):
        raise ValueError("give exactly one of --num-params and --model")
    if args.model is not None:
        model = build_on_meta(args.model)
        groups = load_factory(args.param_groups, "--param-groups")(model) if args.param_groups else None
        return model_info(model, param_groups=groups), args.model
    if args.param_groups is not None:
        raise ValueError("--param-groups needs --model (the groups are read from the model's parameters)")
    return args.num_params, f"{args.num_params:.4g} parameters"


def _precision(args) -> Optional[str]:
    if args.precision is not None or args.config is not None:
        return args.precision  # None: the estimator reads the config's
    return "fp16"


def run(argv: Optional[list] = None) -> str:
    """Parse ``argv`` and return the tables as text."""
    args = build_parser().parse_args(argv)
    config = ZeroConfig.coerce(args.config)
    subject, label = _subject(args)
    blocks = []
    for world_size in args.world_size:
        estimates = estimate_memory(subject, config, world_size, stages=args.stages,
                                    precision=_precision(args),
                                    optimizer_state_bytes=args.optimizer_state_bytes, device=args.device)
        numel = estimates[0].numel if estimates else 0
        blocks.append(f"{label}: Ψ = {numel:,} trainable elements, {world_size} ranks, "
                      f"{estimates[0].precision if estimates else ''}\n\n" + format_table(estimates, args.unit)
                      + placement_table(estimates, config, args.unit) + bucket_note(estimates, config))
    return "\n\n".join(blocks)


def placement_table(estimates, config: ZeroConfig, unit: str) -> str:
    """With offload in the config: the totals by place (accelerator, host memory, NVMe), stage by stage."""
    from zero_core.offload.estimate import placement_bytes

    if not any(b is not None and b.device != "none" for b in (config.offload_optimizer, config.offload_param)):
        return ""
    lines = ["", "", f"with the config's offload, in {unit}", "", "| stage | accelerator | host | nvme |",
             "| --- | --- | --- | --- |"]
    for e in estimates:
        if e.stage == 0:
            continue
        place = placement_bytes(e, config)
        lines.append(f"| {e.stage} | " + " | ".join(_fmt(b / UNITS[unit]) for b in
                                                    (place.accelerator, place.host, place.nvme)) + " |")
    return "\n".join(lines)


def bucket_note(estimates, config: ZeroConfig) -> str:
    """What the bucket sizes cost: DeepSpeed's defaults (5e8 elements) make one bucket of a whole small model,
    so scratch and the step's fp32 tile can rival the model states."""
    if not estimates:
        return ""
    e = estimates[0]
    element = 4 if e.precision == "fp32" else 2
    numel = max(e.numel, 1)
    default = ZeroConfig()

    def field(name: str) -> str:
        value = getattr(config, name)
        return f"{name} = {value:,}" + (" (default)" if value == getattr(default, name) else "")

    bucket = flat_bucket_numel(config)
    lines = ["", "", "Bucket sizes, in elements: " + ", ".join(field(n) for n in (
        "reduce_bucket_size", "allgather_bucket_size", "sub_group_size")) + ".",
        f"- One bucket buffer holds up to min(bucket, Ψ) elements: {min(bucket, numel) * element:,} bytes here "
        f"({e.precision}); at {bucket:,} elements a buffer can reach {bucket * element:,} bytes. Stages 1-2 reduce "
        "each bucket in place; stage 2 holds a staging copy of each bucket being filled or reduced; stage 3 holds one or two reduction buffers. Those bytes are the `buffers` column (with a model; "
        "0 for a bare count).",
        f"- The step copies 16-bit gradients to fp32 in tiles of min(sub_group_size, reduce_bucket_size) = "
        f"{step_tile_numel(config):,} elements: the `step tile` column, a transient besides `buffers`."]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> None:
    try:
        print(run(argv))
    except (ValueError, TypeError, ImportError) as err:
        raise SystemExit(f"zero-estimate: error: {err}") from None


if __name__ == "__main__":
    main()
