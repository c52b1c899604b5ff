"""Run Accelerate's own test scripts, as shipped in the wheel and unmodified, with ZeroAccelerator swapped in.

    accelerate launch --config_file cfg.yaml stock_scripts.py OUT.json RUN [RUN ...]

Each RUN is ``<script>:<json of environment variables>``, e.g. ``test_script.py:{"ACCELERATE_ZERO_STAGE": "3"}``.
``accelerate_zero.swap.install()`` rebinds ``accelerate.Accelerator`` to ``ZeroAccelerator`` (nothing is
written to the scripts or the installed package), then every run executes in this process through ``runpy``,
one after another, so one launch covers several stages. Between runs the Accelerate singletons are reset
and a fresh process group is built on the launcher's store under a new prefix (the scripts destroy theirs
at the end). Rank 0 writes ``{"runs": [{"run": ..., "ok": ..., "error": ..., "engines": [...]}]}`` after every
run, where ``engines`` lists the stage of every ZeRO engine the run built (proof that the swap took effect).
"""

import json
import os
import runpy
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState

import accelerate
import zero_core
from accelerate_zero import swap

ENGINES = []  # the stage of each engine built, in order


def counting_setup(setup):
    def wrapped(model, optimizer, config=None, process_group=None):
        engine = setup(model, optimizer, config, process_group)
        ENGINES.append(engine.config.stage)
        return engine

    return wrapped

SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"


def fresh_process_group(run: int) -> None:
    """A new world on the launcher's store; the prefix keeps it apart from the previous run's keys."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.PrefixStore(f"stock-run-{run}", store), rank=rank, world_size=world)


def run_one(index: int, spec: str) -> dict:
    script, _, env_json = spec.partition(":")
    os.environ.update(json.loads(env_json or "{}"))
    if index > 0:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        fresh_process_group(index)
    ENGINES.clear()
    try:
        sys.argv = [str(SCRIPTS / script)]
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
        return {"run": spec, "ok": True, "error": None, "engines": list(ENGINES)}
    except Exception:  # recorded, and the next run still goes
        return {"run": spec, "ok": False, "error": traceback.format_exc()[-3000:], "engines": list(ENGINES)}
    finally:
        for key in json.loads(env_json or "{}"):
            os.environ.pop(key, None)


def main() -> None:
    out, specs = Path(sys.argv[1]), sys.argv[2:]
    swap.install()
    zero_core.setup = counting_setup(zero_core.setup)
    results = []
    for index, spec in enumerate(specs):
        results.append(run_one(index, spec))
        if int(os.environ.get("RANK", "0")) == 0:
            out.write_text(json.dumps({"runs": results}, indent=2))


if __name__ == "__main__":
    main()
