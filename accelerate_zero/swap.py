"""Run an unmodified Accelerate script with ``ZeroAccelerator`` in place of ``accelerate.Accelerator``.

    accelerate-zero launch --config zero.yaml --swap-accelerator train.py ...
    accelerate launch --config_file cfg.yaml -m accelerate_zero.swap train.py ...

Before the script runs (as ``__main__``, through ``runpy``), the name ``Accelerator`` in ``accelerate`` and
``accelerate.accelerator`` is rebound to ``ZeroAccelerator``, a subclass, so ``from accelerate import
Accelerator`` in the script (or in any module it imports) gets ZeRO. At stage 3, ``from_pretrained`` also
builds the model already partitioned (pretrained.py), as ``HfDeepSpeedConfig`` does for DeepSpeed. Nothing is written to the script or to
the installed accelerate package; the rebinding lives only in that worker process.
"""

from __future__ import annotations

import os
import runpy
import sys


def install() -> None:
    """Rebind ``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator`` to ``ZeroAccelerator``."""
    import accelerate
    import accelerate.accelerator

    from .accelerator import ZeroAccelerator, init_for_restart_attempt
    from .plugin import ZeroPlugin
    from .pretrained import install_if_stage3

    accelerate.Accelerator = ZeroAccelerator
    accelerate.accelerator.Accelerator = ZeroAccelerator
    install_if_stage3(ZeroPlugin.from_env())  # stage 3: from_pretrained builds the model partitioned
    # Before the script runs: a Hugging Face TrainingArguments makes the process group before any Accelerator.
    init_for_restart_attempt(cpu=os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
                             or not _cuda_available())


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    script = args[0]
    if not os.path.isfile(script):
        raise SystemExit(f"accelerate_zero.swap: no script at {script}")
    install()
    sys.argv = args  # the script sees its own name and arguments, as under `python script.py ...`
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
