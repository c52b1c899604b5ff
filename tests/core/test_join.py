"""Uneven inputs: under ``engine.join()`` rank 0 trains on 5 batches and rank 1 on 7, at stages 1-3, and every
rank ends with the weights of DistributedDataParallel under ``torch.distributed.algorithms.Join`` on the same
batches (where the joined rank shadows the all-reduce with zeros and the last joiner's weights are kept).
"""

from __future__ import annotations

import pytest
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from reference import make_optimizer
from stage3_support import batch, build, capture, full_params, max_abs_diff, unwrap

BATCHES = {0: 5, 1: 7}
CONFIGS = {
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "stage 3, partitioned": {"stage": 3, "param_persistence_threshold": 0},
}
# A model with blocks: the shadowing rank replays the root group's gathers (root_group.py) as the others run them.
TRANSFORMER_CONFIGS = {
    "transformer, stage 3, partitioned": {"stage": 3, "param_persistence_threshold": 0},
    "transformer, stage 3, partitioned, no reuse": {"stage": 3, "param_persistence_threshold": 0,
                                                    "max_reuse_distance": 0, "prefetch_bucket_size": 2000},
}
TOLERANCE = 1e-5


def ddp_under_join(rank: int, name: str = "mlp") -> dict:
    model = build(name)
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    with Join([ddp]):
        for step in range(BATCHES[rank]):
            ddp(*batch(name, rank, step, 0)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def engine_under_join(rank: int, config: dict, name: str = "mlp") -> dict:
    model = build(name)
    engine = zero_core.setup(model, make_optimizer(model), config)
    with engine.join():
        for step in range(BATCHES[rank]):
            engine.backward(model(*batch(name, rank, step, 0)))
            engine.step()
    return full_params(model)


def join_worker(rank, world_size):
    reference = ddp_under_join(rank)
    found = {name: capture(lambda c: max_abs_diff(engine_under_join(rank, c), reference), config)
             for name, config in CONFIGS.items()}
    reference = ddp_under_join(rank, "transformer")
    found.update({name: capture(lambda c: max_abs_diff(engine_under_join(rank, c, "transformer"), reference), config)
                  for name, config in TRANSFORMER_CONFIGS.items()})
    return found


_RESULTS: list = []


def results() -> list[dict]:
    if not _RESULTS:
        _RESULTS.extend(run_distributed(join_worker, 2, timeout=200))
    return _RESULTS


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", list(CONFIGS) + list(TRANSFORMER_CONFIGS))
def test_join_with_5_and_7_batches_matches_ddp_under_join(name):
    for rank, found in enumerate(results()):
        diff = unwrap(found[name])
        assert diff <= TOLERANCE, f"rank {rank} [{name}]: weights {diff:.2e} away from DDP under Join"
