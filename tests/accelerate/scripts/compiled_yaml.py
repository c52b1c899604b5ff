"""examples/accelerate_train.py compiled through zero.yaml's ``dynamo_config``: plain Accelerate DDP and
ZeroAccelerator at stages 1, 2 and 3 in one launch, each compiled by Accelerate from the launcher's environment
(no ``dynamo_backend`` argument anywhere in this script).

    accelerate-zero launch --config zero.yaml compiled_yaml.py OUT.json
"""

import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from common import load_example, write_json
from parity import MAX_NORM, parity_run

RUNS = {"ddp": "ddp", "zero1": {"stage": 1}, "zero2": {"stage": 2},
        "zero3": {"stage": 3, "param_persistence_threshold": 0}}


def main() -> None:
    example = load_example()
    results = {}
    for name, kind in RUNS.items():
        torch._dynamo.reset()
        counters.clear()
        results[name] = parity_run(example, kind)
        # frames dynamo compiled (compiled DDP's graphs go through dynamo's DDP optimizer, not unique_graphs)
        results[name]["compiled_frames"] = counters["frames"]["ok"]
    results["max_norm"] = MAX_NORM
    write_json(sys.argv[1], results)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
