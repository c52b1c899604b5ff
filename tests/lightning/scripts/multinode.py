"""One zero3 fit (with hpZ over pairs of ranks) on 4 ranks, laid out as 1 node x 4 devices or 2 nodes x 2 devices
(simulated on this machine). The engine reads the nodes from Lightning's launcher (NODE_RANK).

    python multinode.py OUT 1x4
    MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> NODE_RANK=0 python multinode.py OUT 2x2   (and NODE_RANK=1)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from common import STAGE3, LitGPT, full_weights, loader, metrics, save_rank, trainer, write_json

from lightning_zero import ZeroStrategy

OUT, LAYOUT = Path(sys.argv[1]), sys.argv[2]
NODES, DEVICES = {"1x4": (1, 4), "2x2": (2, 2)}[LAYOUT]

if __name__ == "__main__":
    model = LitGPT()
    t = trainer(ZeroStrategy(config={**STAGE3, "zero_hpz_partition_size": 2}), OUT, devices=DEVICES, num_nodes=NODES, max_epochs=1,
                accumulate_grad_batches=2, gradient_clip_val=0.05)
    t.fit(model, loader())
    save_rank(OUT, f"multinode_{LAYOUT}", full_weights(model))
    t.save_checkpoint(OUT / f"multinode_{LAYOUT}.ckpt")
    write_json(OUT, f"multinode_{LAYOUT}", {"fit": metrics(t), "world_size": dist.get_world_size(),
                                            "global_step": t.global_step, "node_rank": t.node_rank,
                                            "zero_nodes": t.strategy.engine.topology.nodes,
                                            "cross_node_bytes": t.strategy.engine.link_bytes()["cross_node"]})
