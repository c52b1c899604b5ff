"""The ``accelerate-zero`` command.

    accelerate-zero launch --config zero.yaml [accelerate launch options] train.py [script arguments]
    accelerate-zero config [--output zero.yaml] [--stage 2] [--num-processes 2] [--mixed-precision no]
    accelerate-zero export-state CHECKPOINT OUT
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from zero_core import ZeroConfigError

from .launch_config import launch_settings, read_launch_config, temporary_yaml, worker_environment
from .starter import starter_yaml

LAUNCH_HELP = """Run a training script under ZeRO from one zero.yaml: Accelerate's usual keys plus a
zero_optimization block. Options after ours (and before the script) go to `accelerate launch` unchanged,
e.g. --main_process_port 29501. The script uses accelerate_zero.ZeroAccelerator, or any Accelerate script
runs unmodified with --swap-accelerator."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="accelerate-zero", description="ZeRO for Hugging Face Accelerate.")
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("launch", help="launch a script from a zero.yaml", description=LAUNCH_HELP,
                                 allow_abbrev=False)
    launch.add_argument("--config", "-c", required=True, help="the zero.yaml (Accelerate keys + zero_optimization)")
    launch.add_argument("--swap-accelerator", action="store_true",
                        help="run an unmodified script: accelerate.Accelerator becomes ZeroAccelerator in the workers")
    launch.add_argument("rest", nargs="*", metavar="...",
                        help="[accelerate launch options] script.py [script arguments]")
    config = commands.add_parser("config", help="write a starter zero.yaml", allow_abbrev=False)
    config.add_argument("--output", "-o", default="zero.yaml", help="where to write it (default: zero.yaml)")
    config.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    config.add_argument("--num-processes", type=int, default=max(torch.cuda.device_count(), 2))
    config.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no")
    config.add_argument("--force", action="store_true", help="overwrite an existing file")
    export = commands.add_parser("export-state", allow_abbrev=False,
                                 help="turn a ZeroAccelerator.save_state directory into one plain Accelerate loads")
    export.add_argument("checkpoint")
    export.add_argument("out")
    return parser


def cmd_launch(args: argparse.Namespace) -> None:
    launch = read_launch_config(args.config)
    rest = list(args.rest)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not any(not a.startswith("-") for a in rest):
        raise SystemExit("accelerate-zero launch: give the training script, e.g. `... --config zero.yaml train.py`")
    if args.swap_accelerator and {"-m", "--module"} & set(_before_script(rest)):
        raise SystemExit("accelerate-zero launch: --swap-accelerator runs a script file; it cannot be combined with -m")
    os.environ.update(worker_environment(launch))  # the launcher copies its environment into every worker
    from accelerate.commands.launch import launch_command, launch_command_parser

    with temporary_yaml(launch_settings(launch.accelerate)[0]) as accelerate_config:
        module = ["-m", "accelerate_zero.swap"] if args.swap_accelerator else []
        argv = ["--config_file", accelerate_config] + _before_script(rest) + module + _from_script(rest)
        launch_command(launch_command_parser().parse_args(argv))


def _script_position(rest: list[str]) -> int:
    """The first argument that is the script: not an option, and not an option's value."""
    from accelerate.commands.launch import launch_command_parser

    takes_value = {opt for action in launch_command_parser()._actions if action.nargs != 0
                   for opt in action.option_strings}
    index = 0
    while index < len(rest) and rest[index].startswith("-"):
        index += 2 if rest[index] in takes_value else 1
    return index


def _before_script(rest: list[str]) -> list[str]:
    return rest[: _script_position(rest)]


def _from_script(rest: list[str]) -> list[str]:
    return rest[_script_position(rest):]


def cmd_config(args: argparse.Namespace) -> None:
    out = Path(args.output)
    if out.exists() and not args.force:
        raise SystemExit(f"{out} exists: pass --force to overwrite it, or --output another path")
    use_cpu = not torch.cuda.is_available()
    out.write_text(starter_yaml(out.name, args.stage, args.num_processes, args.mixed_precision, use_cpu))
    read_launch_config(out)  # what we write must be what we accept
    print(f"wrote {out}; run: accelerate-zero launch --config {out} train.py")


def cmd_export(args: argparse.Namespace) -> None:
    from .export import export_accelerate_state

    out = export_accelerate_state(args.checkpoint, args.out)
    print(f"wrote {out}: load it with accelerator.load_state({str(out)!r}) in a plain Accelerate run")


_OWN_LAUNCH_FLAGS = {"--swap-accelerator", "-h", "--help"}
_OWN_LAUNCH_VALUED = {"--config", "-c"}


def _parse(argv: list[str]) -> argparse.Namespace:
    """argparse for our own options; for ``launch`` everything from the first foreign token on is kept as is
    (accelerate launch options, the script, its arguments), since argparse would claim some of it."""
    if argv[:1] != ["launch"]:
        return build_parser().parse_args(argv)
    index = 1
    while index < len(argv):
        token = argv[index]
        if token in _OWN_LAUNCH_VALUED:
            index += 2
        elif token in _OWN_LAUNCH_FLAGS or token.startswith("--config="):
            index += 1
        else:
            break
    args = build_parser().parse_args(argv[:index])
    args.rest = argv[index:]
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    handlers = {"launch": cmd_launch, "config": cmd_config, "export-state": cmd_export}
    try:
        handlers[args.command](args)
    except (ZeroConfigError, FileNotFoundError, FileExistsError) as err:
        raise SystemExit(f"accelerate-zero {args.command}: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
