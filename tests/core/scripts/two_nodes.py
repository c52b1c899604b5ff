"""One node's ranks of a 2-node run, launched by torchrun per node (tests/multinode/test_multinode_launch.py).

Usage: torchrun --nnodes 2 --node-rank I --nproc-per-node 2 --master-addr 127.0.0.1 --master-port P two_nodes.py OUT
Trains the DDP reference and ZeRO-3 with hpZ, MiCS and full ZeRO++ on the same data; global rank 0 writes the
topology each engine saw, the weight differences and the loss gaps to OUT (JSON).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: models, reference

from models import build_model, make_batch  # noqa: E402
from reference import train_ddp  # noqa: E402
from stage3_support import train_engine  # noqa: E402

STEPS = 4
Z3 = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0}
CONFIGS = {
    "hpz": {**Z3, "zero_hpz_partition_size": 2},
    "mics": {**Z3, "mics_shard_size": 2},
    "zeropp": {**Z3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}


def _model():
    return build_model("transformer")


def _data(rank, step, micro):
    return make_batch("transformer", rank, step, micro)


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    reference = train_ddp(_model, _data, STEPS)
    report = {}
    for name, config in CONFIGS.items():
        result, engine = train_engine(_model, _data, config, STEPS)
        topology = engine.topology
        report[name] = {
            "nodes": topology.nodes, "mesh": list(topology.mesh.shape) if topology.mesh is not None else None,
            "shard_group": topology.world_size, "replicas": topology.replicas,
            "diff": max((result.params[k] - reference.params[k]).abs().max().item() for k in reference.params),
            "loss_gap": max(abs(a - b) / abs(b) for a, b in zip(result.losses, reference.losses)),
            "cross_node_bytes": engine.link_bytes()["cross_node"],
        }
        engine.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
