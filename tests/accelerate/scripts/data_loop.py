"""Run the test functions of Accelerate's own ``test_distributed_data_loop.py`` (as shipped in the wheel, unmodified),
plain or with ZeroAccelerator swapped in, at several stages in one launch.

    accelerate launch --config_file cfg.yaml data_loop.py OUT MODE RUN [RUN ...]

MODE is ``plain`` or ``zero``; each RUN is ``STAGE:FUNCTION,FUNCTION,...`` (STAGE is ignored when plain). A run's
functions are called in the order given, the way the script's ``main()`` calls them (those that take arguments
get the accelerator ``main()`` builds), with ``ACCELERATE_ZERO_STAGE=STAGE``; between runs the Accelerate
singletons are reset and a fresh process group is built under a new prefix of the launcher's store. Every
function runs even after one fails (a failure is recorded with its traceback). After each function every rank
writes ``OUT.rank<R>.json``: ``{"runs": [{"stage": ..., "results": {function: error or null}, "engines": [...]}]}``, where ``engines`` lists
the stage of every ZeRO engine built (proof that the swap took effect); a hang still leaves the record.
"""

import importlib.util
import inspect
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils.dataclasses import DistributedType

import accelerate
import zero_core
from accelerate_zero import swap

SCRIPT = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_distributed_data_loop.py"
ENGINES = []


def load_script():
    """The script as a module (not run: its ``main()`` stops at the first failure and needs every part to pass)."""
    spec = importlib.util.spec_from_file_location("test_distributed_data_loop", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(module, name: str) -> None:
    function = getattr(module, name)
    if not inspect.signature(function).parameters:
        function()
        return
    accelerator = module.create_accelerator()  # as main() builds it
    torch.manual_seed(accelerator.process_index)
    if name == "test_join_raises_warning_for_non_ddp_distributed":  # main() fakes FSDP around this one
        original = accelerator.state.distributed_type
        accelerator.state.distributed_type = DistributedType.FSDP
        try:
            function(accelerator)
        finally:
            accelerator.state.distributed_type = original
    elif name == "test_data_loader":  # main()'s first loader: shuffle=False
        loader = module.DataLoader(module.DummyDataset(), shuffle=False, batch_size=module.BATCH_SIZE,
                                   num_workers=module.NUM_WORKERS)
        function(loader, accelerator)
    else:
        function(accelerator)


def fresh_process_group(run: int) -> None:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.PrefixStore(f"data-loop-{run}", store), rank=rank, world_size=world)


def counting_setup(setup):
    def wrapped(*args, **kwargs):
        engine = setup(*args, **kwargs)
        ENGINES.append(engine.config.stage)
        return engine

    return wrapped


def main() -> None:
    out, mode, specs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if mode == "zero":
        swap.install()
        zero_core.setup = counting_setup(zero_core.setup)
    module = load_script()  # after the swap: the script's `from accelerate.accelerator import Accelerator`
    runs = []
    for index, spec in enumerate(specs):
        stage, _, functions = spec.partition(":")
        names = functions.split(",")
        if mode == "zero":
            os.environ["ACCELERATE_ZERO_STAGE"] = stage
        if index > 0:
            fresh_process_group(index)
        ENGINES.clear()
        results = {}
        for name in names:
            try:
                call(module, name)
                results[name] = None
            except Exception:  # recorded; the next function still runs
                results[name] = traceback.format_exc()[-2500:]
            # every rank: the script's checks differ per rank (rank 1's batches are not rank 0's)
            record = runs + [{"stage": stage, "results": results, "engines": list(ENGINES)}]
            Path(f"{out}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"runs": record}, indent=2))
        runs.append({"stage": stage, "results": results, "engines": list(ENGINES)})
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
