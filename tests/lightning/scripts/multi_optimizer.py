"""Several optimizers (a GAN under manual optimization) and a second fit of the same module, against DDP.

    python tests/lightning/scripts/multi_optimizer.py OUT_DIR [part ...]   (Lightning's launcher starts rank 1)

gan: generator and discriminator each with its own optimizer and scheduler, toggled_optimizer, norm clipping of
the generator only, sync_dist logging; under DDP (find_unused_parameters, as Lightning asks for GANs) and zero1/2/3.
zero3 also resumes from its epoch-0 checkpoint; DDP and zero2 resume from that checkpoint converted to one file.
refit: fit, then fit again with a new Trainer (fresh optimizers and schedulers), under DDP, zero2 and zero3.
fabric_gan: the same GAN with Fabric, ``fabric.setup(model, opt_g, opt_d)``, under Fabric's DDP and zero2/zero3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from common import STAGE3, LitGPT, full_weights, loader, message_of, metrics, save_rank, trainer, write_json
from models import GanPair, gan_dataset

import lightning_zero  # noqa: F401
from lightning_zero import ZeroFabricStrategy, ZeroStrategy
from lightning_zero.convert import convert_to_single_file

OUT = Path(sys.argv[1])
DDP_GAN = "ddp_find_unused_parameters_true"  # the other network's parameters get no gradient in each backward


class LitGAN(pl.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gan = GanPair(seed)

    def training_step(self, batch, batch_idx):
        noise, real = batch
        opt_g, opt_d = self.optimizers()
        sched_g, sched_d = self.lr_schedulers()
        with self.toggled_optimizer(opt_g):
            g_loss = self.gan(noise, real, "generator")
            self.manual_backward(g_loss)
            self.clip_gradients(opt_g, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt_g.step()
            opt_g.zero_grad()
        with self.toggled_optimizer(opt_d):
            d_loss = self.gan(noise, real, "discriminator")
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
        sched_g.step()
        if self.trainer.is_last_batch:
            sched_d.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, sync_dist=True)

    def configure_optimizers(self):
        opt_g, opt_d = gan_optimizers(self.gan)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.7),
                                torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.5)]


def gan_optimizers(gan: GanPair) -> tuple:
    return (torch.optim.Adam(gan.generator.parameters(), lr=1e-2, betas=(0.5, 0.9)),
            torch.optim.SGD(gan.discriminator.parameters(), lr=5e-2, momentum=0.9, weight_decay=0.1))


def gan_loader() -> DataLoader:
    return DataLoader(gan_dataset(), batch_size=4, shuffle=True)


def summary(fit: pl.Trainer) -> dict:
    return {"metrics": metrics(fit), "global_step": fit.global_step,
            "optimizers": [type(o).__name__ for o in fit.optimizers],
            "lrs": [o.param_groups[0]["lr"] for o in fit.optimizers]}


def gan() -> None:
    strategies = {"ddp": DDP_GAN, "zero1": ZeroStrategy(stage=1), "zero2": ZeroStrategy(stage=2),
                  "zero3": ZeroStrategy(stage=3, config=STAGE3)}
    results = {}
    for name, strategy in strategies.items():
        pl.seed_everything(0)
        model = LitGAN()
        fit = trainer(strategy, OUT)
        fit.fit(model, gan_loader())
        save_rank(OUT, f"gan_{name}", full_weights(model))
        results[name] = summary(fit)
    results["resumed"] = resume_zero3_then_ddp()
    write_json(OUT, "gan", results)


def resume_zero3_then_ddp() -> dict:
    """zero3 for one epoch, saved; a differently seeded model resumes it for the second; then DDP resumes from the
    same checkpoint converted to one file."""
    pl.seed_everything(0)
    model = LitGAN()
    first = trainer(ZeroStrategy(stage=3, config=STAGE3), OUT, max_epochs=1)
    first.fit(model, gan_loader())
    checkpoint = OUT / "gan_epoch0.ckpt"
    first.save_checkpoint(checkpoint)
    resumed = LitGAN(seed=5)
    second = trainer(ZeroStrategy(stage=3, config=STAGE3), OUT)
    second.fit(resumed, gan_loader(), ckpt_path=str(checkpoint))
    save_rank(OUT, "gan_zero3_resumed", full_weights(resumed))
    single = OUT / "gan_epoch0_single.ckpt"
    if dist.get_rank() == 0:
        convert_to_single_file(checkpoint, single)
    dist.barrier()
    from_file = LitGAN(seed=5)
    third = trainer(DDP_GAN, OUT)
    third.fit(from_file, gan_loader(), ckpt_path=str(single))
    save_rank(OUT, "gan_ddp_from_converted", full_weights(from_file))
    into_zero = LitGAN(seed=5)  # and the single file (two plain optimizer states) back into the engine
    trainer(ZeroStrategy(stage=2), OUT).fit(into_zero, gan_loader(), ckpt_path=str(single))
    save_rank(OUT, "gan_zero2_from_converted", full_weights(into_zero))
    return {"zero3": summary(second), "ddp": summary(third),
            "converted_optimizers": len(torch.load(single, weights_only=True)["optimizer_states"])}


def refit() -> None:
    results = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero2", lambda: ZeroStrategy(stage=2)),
                           ("zero3", lambda: ZeroStrategy(stage=3, config=STAGE3))):
        pl.seed_everything(0)
        model = LitGPT()
        fits = []
        for which in ("first", "second"):
            fit = trainer(strategy(), OUT, max_epochs=1)  # a new Trainer and strategy each time
            fit.fit(model, loader())
            fits.append(fit.global_step)
            save_rank(OUT, f"refit_{name}_{which}", full_weights(model))
        results[name] = {"global_steps": fits, "lr": fit.optimizers[0].param_groups[0]["lr"]}
    results["other_precision"] = message_of(
        lambda: trainer(ZeroStrategy(stage=3, config=STAGE3), OUT, max_epochs=1, precision="bf16-mixed").fit(
            model, loader()))
    write_json(OUT, "refit", results)


def fabric_gan_run(strategy) -> dict:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = GanPair()
    model, opt_g, opt_d = fabric.setup(model, *gan_optimizers(model))
    for noise, real in fabric.setup_dataloaders(gan_loader()):
        for which, optimizer, other in (("generator", opt_g, model.discriminator),
                                        ("discriminator", opt_d, model.generator)):
            other.requires_grad_(False)
            fabric.backward(model(noise, real, which))
            if which == "generator":
                fabric.clip_gradients(model, optimizer, max_norm=0.05)
            optimizer.step()
            optimizer.zero_grad()
            other.requires_grad_(True)
    return full_weights(model.module)


def fabric_gan() -> None:
    save_rank(OUT, "fabric_gan_ddp", fabric_gan_run("ddp_find_unused_parameters_true"))
    save_rank(OUT, "fabric_gan_zero2", fabric_gan_run(ZeroFabricStrategy(stage=2)))
    save_rank(OUT, "fabric_gan_zero3", fabric_gan_run(ZeroFabricStrategy(stage=3, config=STAGE3)))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    parts = {"gan": gan, "refit": refit, "fabric_gan": fabric_gan}
    for part in sys.argv[2:] or list(parts):
        parts[part]()
    dist.barrier()
