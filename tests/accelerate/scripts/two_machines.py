"""examples/accelerate_train.py under plain Accelerate DDP and under ZeroAccelerator with MiCS and hpZ, launched as
two machines of two processes (``accelerate launch --num_machines 2 --machine_rank i``,
tests/multinode/test_multinode_launch.py).

    accelerate launch --num_machines 2 --machine_rank I --num_processes 4 ... two_machines.py OUT.json

Rank 0 writes each run's final weights and the node count the engine read from the launcher.
"""

import sys

import torch

from common import load_example, make_accelerator, rank, to_lists, write_json

STEPS = 4
RUNS = {
    "ddp": "ddp",
    "mics": {"stage": 3, "mics_shard_size": 2, "param_persistence_threshold": 0},
    "hpz": {"stage": 3, "zero_hpz_partition_size": 2, "param_persistence_threshold": 0, "max_reuse_distance": 0},
}


def main() -> None:
    example = load_example()
    results = {}
    for name, kind in RUNS.items():
        accelerator = make_accelerator(kind)
        model, _ = example.train(accelerator, STEPS)
        state = accelerator.get_state_dict(model)
        results[name] = {"weights": to_lists(state) if rank() == 0 else None}
        if kind != "ddp":
            engine = accelerator.zero_engine(model)
            results[name].update(nodes=engine.topology.nodes, replicas=engine.topology.replicas,
                                 cross_node_bytes=engine.link_bytes()["cross_node"])
    write_json(sys.argv[1], results)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
