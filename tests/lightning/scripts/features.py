"""Manual optimization, bf16/fp16, sync_batchnorm and Fabric under ZeRO, each against what it must equal.

    python tests/lightning/scripts/features.py OUT_DIR [part ...]     (Lightning's launcher starts the 2nd rank)
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from common import (STAGE3, VOCAB, LitGPT, TinyGPT, full_weights, loader, message_of, metrics, save_rank, trainer,
                    write_json)

import lightning_zero  # noqa: F401
from lightning_zero import ZeroFabricStrategy, ZeroPrecision, ZeroStrategy

OUT = Path(sys.argv[1])


class LitManual(LitGPT):
    """Manual optimization: accumulate 2, clip by value, step the scheduler by hand."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sch = self.optimizers(), self.lr_schedulers()
        with self.toggled_optimizer(opt):
            loss, _, _ = self.loss(batch)
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                self.clip_gradients(opt, gradient_clip_val=0.003, gradient_clip_algorithm="value")
                opt.step()
                opt.zero_grad()
                sch.step()
        self.log("train_loss", loss, sync_dist=True)


def manual() -> None:
    for name, strategy in (("ddp", "ddp"), ("zero3", ZeroStrategy(stage=3, config=STAGE3))):
        model = LitManual()
        trainer(strategy, OUT).fit(model, loader())
        save_rank(OUT, f"manual_{name}", full_weights(model))


class DtypeProbe(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.seen = {"param": str(module.model.blocks[0].fc1.weight.dtype),
                     "master": str(trainer.optimizers[0].optimizer.param_groups[0]["params"][0].dtype),
                     "loss_scale": engine.loss_scale, "skipped": engine.skipped_steps}


def precision() -> None:
    results = {}
    runs = {
        "bf16_mixed": dict(strategy=ZeroStrategy(stage=3, config=STAGE3), precision="bf16-mixed"),
        "bf16_true_configure_model": dict(strategy=ZeroStrategy(stage=3, config=STAGE3), precision="bf16-true"),
        # Lightning turns precision="16-mixed" into bf16 on CPU before a strategy sees it: pass the plugin.
        "fp16_mixed": dict(strategy=ZeroStrategy(stage=2, config={"fp16": {"initial_scale_power": 24,
                                                                           "hysteresis": 1}}),
                           plugins=[ZeroPrecision("16-mixed")]),
    }
    for name, kwargs in runs.items():
        probe = DtypeProbe()
        model = LitGPT(in_configure_model="configure_model" in name)
        t = trainer(kwargs.pop("strategy"), OUT, callbacks=[probe], **kwargs)
        t.fit(model, loader(), loader(shuffle=False))
        results[name] = {"fit": metrics(t), "probe": probe.seen, "plugin": type(t.precision_plugin).__name__,
                         "flag": t.precision_plugin.precision,
                         "test": t.test(model, loader(shuffle=False), verbose=False)[0]["test_loss"],
                         "predict": float(torch.stack(t.predict(model, loader(shuffle=False))).float().mean())}
        save_rank(OUT, f"precision_{name}", {**full_weights(model), "_skipped": torch.tensor(probe.seen["skipped"])})
    write_json(OUT, "precision", results)


class LitBN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val", self.net(batch[0]).mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sync_batchnorm() -> None:
    """torch's SyncBatchNorm only trains on GPUs: on CPU check the conversion and evaluation."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    model = LitBN()
    t = trainer("zero2", OUT, sync_batchnorm=True, limit_train_batches=0, max_epochs=1)
    t.fit(model, data)
    out = t.validate(model, data, verbose=False)[0]
    write_json(OUT, "sync_batchnorm", {"converted": type(model.net[1]).__name__, "val": out["val"]})


def fabric_train(strategy, save_to=None):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        torch.manual_seed(0)
        model = TinyGPT()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    for i, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
        accumulate = i % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulate):
            fabric.backward(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)) / 2)
        if not accumulate:
            fabric.clip_gradients(model, optimizer, max_norm=0.05)
            optimizer.step()
            optimizer.zero_grad()
    if save_to is not None:
        fabric.save(save_to, {"model": model, "optimizer": optimizer, "step": i})
    return fabric, model, optimizer


class LitLBFGS(LitGPT):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class LitSkipSecond(LitGPT):
    """training_step returns None for batch 1 on every rank."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def errors() -> None:
    found = {}
    found["lbfgs"] = message_of(lambda: trainer("zero1", OUT, max_steps=1).fit(LitLBFGS(), loader()))
    model = LitGPT()
    trainer("zero2", OUT, max_steps=1).fit(model, loader())
    found["missing_checkpoint"] = message_of(
        lambda: trainer("zero2", OUT).test(model, loader(), ckpt_path=str(OUT / "no-such.ckpt")))
    # Lightning itself refuses a None training_step with several processes; ZeRO must not change that.
    found["return_none"] = message_of(lambda: trainer("zero2", OUT, max_epochs=1).fit(LitSkipSecond(), loader()))
    write_json(OUT, "errors", found)


def fabric() -> None:
    _, model, _ = fabric_train("ddp", save_to=OUT / "fabric_ddp.ckpt")  # one file (rank 0 writes it)
    save_rank(OUT, "fabric_ddp", full_weights(model.module))
    path = OUT / "fabric_zero3.ckpt"
    _, model, _ = fabric_train(ZeroFabricStrategy(stage=3, config=STAGE3), save_to=path)
    save_rank(OUT, "fabric_zero3", full_weights(model.module))
    fabric2 = Fabric(accelerator="cpu", devices=2, strategy="zero3")  # the registered name, default config
    fabric2.launch()
    with fabric2.init_module():
        fresh = TinyGPT()
    fresh, optimizer = fabric2.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=0.01))
    rest = fabric2.load(path, {"model": fresh, "optimizer": optimizer})
    save_rank(OUT, "fabric_zero3_loaded", full_weights(fresh.module))
    fabric3 = Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric3.launch()
    from_ddp = TinyGPT()
    from_ddp, optimizer3 = fabric3.setup(from_ddp, torch.optim.AdamW(from_ddp.parameters(), lr=0.01))
    fabric3.load(OUT / "fabric_ddp.ckpt", {"model": from_ddp, "optimizer": optimizer3, "step": 0})
    save_rank(OUT, "fabric_zero3_from_ddp", full_weights(from_ddp.module))
    write_json(OUT, "fabric", {"rest": sorted(rest), "step": rest.get("step"),
                               "optimizer_state": len(optimizer.state)})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    parts = {"manual": manual, "precision": precision, "sync_batchnorm": sync_batchnorm, "fabric": fabric,
             "errors": errors}
    for part in sys.argv[2:] or list(parts):
        parts[part]()
    dist.barrier()
