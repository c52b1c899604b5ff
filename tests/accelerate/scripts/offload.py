"""examples/accelerate_train.py under plain Accelerate DDP and under ZeroAccelerator() configured by zero.yaml's
Accelerate-named offload keys (optimizer and parameters on NVMe).

    accelerate-zero launch --config zero.yaml offload.py OUT.json

Rank 0 writes both runs' final weights and norms, where the engine put the optimizer and the parameters, and
whether that engine's swap files still exist after ``accelerator.end_training()`` (which closes the engine).
"""

import os
import sys

import torch

from common import make_accelerator, rank, write_json, load_example
from parity import parity_run


def main() -> None:
    example = load_example()
    results = {"ddp": parity_run(example, "ddp"), "offload": parity_run(example, "env")}
    accelerator = make_accelerator("env")  # the same settings again, to look at the engine's placement
    model, _ = example.train(accelerator, 1)
    engine = accelerator.zero_engine(model)
    swap = engine.runtime.param_swap
    results["placement"] = {
        "optimizer": engine._offload.device if engine._offload is not None else "none",
        "param_units_in_file": sum(unit.swap is swap for unit in engine.runtime.units) if swap is not None else 0,
        "files": sorted(os.listdir(os.environ["OFFLOAD_TEST_NVME"])) if rank() == 0 else [],
    }
    paths = [engine._offload.swapper.path, swap.path]
    torch.distributed.barrier()  # every rank listed the files
    accelerator.end_training()  # closes the engine, then destroys the process group
    results["files_after_end_training"] = [path for path in paths if os.path.exists(path)]
    write_json(sys.argv[1], results)


if __name__ == "__main__":
    main()
