"""A short stage-3 run that trains, destroys its process group and returns; for tests/reliability/test_clean_exit.py.

Usage: python train_and_exit.py {close|forget} (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).
"close" leaves a ``with engine:`` block before destroy_process_group(); "forget" never calls close() and relies
on the engine's finaliser. Prefetch and overlap are on, so collectives are in flight until the last moment.
"""

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

import zero_core

CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True, "reduce_bucket_size": 64}


def main(mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(12, 12) for _ in range(4)])
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), CONFIG)
    with engine if mode == "close" else contextlib.nullcontext():
        for step in range(3):
            loss = model(torch.randn(4, 12)).pow(2).mean()
            loss.backward()
            engine.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
