"""Node-local checkpoints (``checkpoint.use_node_local_storage``) through ZeroStrategy on 2 simulated nodes x 2
devices (tests/lightning/test_lightning_multinode.py). Each node runs in its own working directory and saves to the same
relative path, as each node would to its own local disk.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> NODE_RANK=i python node_local.py OUT   (cwd: node i's directory)

The uninterrupted fit (2 epochs) saves at the end of epoch 0; a second fit resumes from that save. Both write
their final weights; each node's first rank lists what its node directory holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl

from common import STAGE3, LitGPT, full_weights, loader, save_rank, trainer

from lightning_zero import ZeroStrategy

OUT = Path(sys.argv[1])
CONFIG = {**STAGE3, "checkpoint": {"use_node_local_storage": True}}
CKPT = "ckpt"  # relative: this node's own directory


class SaveAfterFirstEpoch(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(CKPT)


def fit(ckpt_path=None, callbacks=()):
    model = LitGPT()
    t = trainer(ZeroStrategy(config=CONFIG), OUT, devices=2, num_nodes=2, max_epochs=2, callbacks=list(callbacks))
    t.fit(model, loader(), ckpt_path=ckpt_path)
    return model, t


if __name__ == "__main__":
    model, _ = fit(callbacks=[SaveAfterFirstEpoch()])
    save_rank(OUT, "node_local_straight", full_weights(model))
    model, t = fit(ckpt_path=CKPT)
    save_rank(OUT, "node_local_resumed", full_weights(model))
    if t.local_rank == 0:
        manifest = json.loads((Path(CKPT) / "manifest.json").read_text())
        report = {"files": sorted(p.name for p in Path(CKPT).iterdir()), "node_local": manifest.get("node_local"),
                  "global_step": t.global_step}
        (OUT / f"node_local.node{t.node_rank}.json").write_text(json.dumps(report))
