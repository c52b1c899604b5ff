"""The model's state dict under ZeRO, where Lightning users read it: ``trainer.strategy.lightning_module_state_dict()``
(``state_dict_type`` "full" and "sharded") and Fabric's ``get_module_state_dict``, against DDP's.

    python tests/lightning/scripts/state_dict.py OUT_DIR     (Lightning's launcher starts the 2nd rank)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import STAGE3, LitGPT, loader, save_rank, trainer
from features import fabric_train

import lightning_zero  # noqa: F401
from lightning_zero import ZeroFabricStrategy, ZeroStrategy

OUT = Path(sys.argv[1])


class LitFrozenPos(LitGPT):
    """The position embedding stays frozen: a parameter outside every optimizer group."""

    def __init__(self):
        super().__init__()
        self.model.pos.weight.requires_grad_(False)


def state_dict() -> None:
    """``lightning_module_state_dict()`` after a short fit, per rank, for DDP and each stage; "sharded" and bf16
    (fp32 masters come out) too, and Fabric's ``get_module_state_dict``."""
    runs = {"ddp": ("ddp", "32-true"), "zero1": (ZeroStrategy(stage=1), "32-true"),
            "zero2": (ZeroStrategy(stage=2), "32-true"), "zero3": (ZeroStrategy(stage=3, config=STAGE3), "32-true"),
            "zero3_sharded": (ZeroStrategy(stage=3, config=STAGE3, state_dict_type="sharded"), "32-true"),
            "zero2_bf16": (ZeroStrategy(stage=2), "bf16-mixed")}
    for name, (strategy, precision_flag) in runs.items():
        model = LitFrozenPos()
        t = trainer(strategy, OUT, max_steps=3, precision=precision_flag)
        t.fit(model, loader())
        got = t.strategy.lightning_module_state_dict()
        if name == "zero2_bf16":
            masters = t.optimizers[0].optimizer.param_groups[0]["params"]
            got["_master_dtype"] = torch.tensor(float(masters[0].dtype == torch.float32))
            got["_param_dtype"] = torch.tensor(float(model.model.blocks[0].fc1.weight.dtype == torch.bfloat16))
        save_rank(OUT, f"state_dict_{name}", {k: v.float() if v.is_floating_point() else v for k, v in got.items()})
        if name == "ddp":
            save_rank(OUT, "state_dict_ddp_keys", list(model.state_dict()))
    excluded_checkpoint()
    fabric_, model, optimizer = fabric_train(ZeroFabricStrategy(stage=3, config=STAGE3))
    save_rank(OUT, "state_dict_fabric_zero3", fabric_.strategy.get_module_state_dict(model))
    classes = {}  # what fabric.save wrote of the optimizer: its state only when the state names the optimizer
    for name, state in (("model", {"model": model}), ("model_optimizer", {"model": model, "optimizer": optimizer})):
        fabric_.save(OUT / f"fabric_{name}", state)
        classes[name] = json.loads((OUT / f"fabric_{name}" / "manifest.json").read_text())["optimizer"]["classes"]
    try:  # the optimizer asked of a checkpoint saved without it: Fabric's strict KeyError, not a fresh optimizer
        fabric_.load(OUT / "fabric_model", {"model": model, "optimizer": optimizer})
        classes["refused"] = None
    except KeyError as error:
        classes["refused"] = str(error)
    fabric_.load(OUT / "fabric_model", {"model": model, "optimizer": optimizer}, strict=False)
    save_rank(OUT, "fabric_saved_optimizer", classes)
    fabric_ddp, model_ddp, _ = fabric_train("ddp")
    save_rank(OUT, "state_dict_fabric_ddp", fabric_ddp.strategy.get_module_state_dict(model_ddp))


def excluded_checkpoint() -> None:
    """``ZeroStrategy(exclude_frozen_parameters=True)``: the checkpoint leaves the frozen position embedding out
    (the manifest names it), and a fit resumed from it into a model built the same way ends with the saved model:
    the trained weights from the checkpoint, the frozen one as built."""
    def strategy() -> ZeroStrategy:
        return ZeroStrategy(stage=3, config=STAGE3, exclude_frozen_parameters=True)

    t = trainer(strategy(), OUT, max_steps=3)
    t.fit(LitFrozenPos(), loader())
    path = OUT / "excluded.ckpt"
    t.save_checkpoint(path)
    saved = t.strategy.lightning_module_state_dict()
    resumed = trainer(strategy(), OUT, max_steps=3)
    resumed.fit(LitFrozenPos(), loader(), ckpt_path=str(path))  # restores, then has no step left to take
    got = resumed.strategy.lightning_module_state_dict()
    manifest = json.loads((path / "manifest.json").read_text())
    save_rank(OUT, "excluded", {"excluded": manifest["excluded_frozen_parameters"],
                                "equal": sorted(saved) == sorted(got) and all(torch.equal(saved[k], got[k])
                                                                             for k in saved)})
    weights_only(t, saved)


def weights_only(fitted, saved: dict) -> None:
    """``trainer.save_checkpoint(path, weights_only=True)`` (what ModelCheckpoint(save_weights_only=True) calls):
    the engine writes no optimizer state; validating from it reads the saved weights, and a fit resumed from it
    raises Lightning's own KeyError, as under DDP."""
    path = OUT / "weights_only.ckpt"
    fitted.save_checkpoint(path, weights_only=True)
    optimizer = json.loads((path / "manifest.json").read_text())["optimizer"]
    checked = trainer(ZeroStrategy(stage=3, config=STAGE3), OUT, max_steps=3)
    model = LitFrozenPos()
    checked.validate(model, loader(), ckpt_path=str(path), verbose=False)
    got = checked.strategy.lightning_module_state_dict()
    resumed = trainer(ZeroStrategy(stage=3, config=STAGE3), OUT, max_steps=5)
    try:
        resumed.fit(LitFrozenPos(), loader(), ckpt_path=str(path))
        refused = None
    except KeyError as error:
        refused = str(error)
    save_rank(OUT, "weights_only", {"classes": optimizer["classes"], "keys": optimizer["per_element_keys"],
                                    "equal": sorted(saved) == sorted(got) and all(torch.equal(saved[k], got[k])
                                                                                 for k in saved),
                                    "refused": refused})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    state_dict()
    dist.barrier()
