"""One model with two optimizers (a GAN) under plain Accelerate DDP and under ZeroAccelerator, in one launch.

    accelerate launch --config_file accelerate.yaml gan.py OUT.json WORKDIR

Runs, each a fresh Accelerator, each ending with the weights (rank 0) that the test compares:
1. ddp: 2 epochs (DDP with find_unused_parameters: each backward leaves the other network without gradients)
2. zero2 and zero3: 2 epochs, ``prepare(model, opt_g, opt_d, loader)``, clipping the generator's parameters only
3. zero3: 1 epoch, save_state; a fresh run loads it and trains the 2nd epoch
4. ddp: loads that ZeRO checkpoint exported to plain Accelerate files and trains the 2nd epoch
"""

import sys
from pathlib import Path

import torch
from accelerate.utils import DistributedDataParallelKwargs
from torch.utils.data import DataLoader

from accelerate_zero import export_accelerate_state
from common import make_accelerator, rank, to_lists, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support, for the shared GAN
from models import GanPair, gan_dataset  # noqa: E402

MAX_NORM = 0.05  # the generator's norm is above it: clipping acts


def data() -> DataLoader:
    return DataLoader(gan_dataset(), batch_size=4)


def start(kind, seed: int = 0):
    if kind == "ddp":
        accelerator = make_accelerator("ddp", gradient_accumulation_steps=1,
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    else:
        accelerator = make_accelerator(kind, gradient_accumulation_steps=1)
    model = GanPair(seed)
    opt_g = torch.optim.Adam(model.generator.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(model.discriminator.parameters(), lr=5e-2, momentum=0.9, weight_decay=0.1)
    return (accelerator, *accelerator.prepare(model, opt_g, opt_d, data()))


def train_epoch(accelerator, model, opt_g, opt_d, loader) -> None:
    inner = accelerator.unwrap_model(model)
    for noise, real in loader:
        for which, optimizer, other in (("generator", opt_g, inner.discriminator),
                                        ("discriminator", opt_d, inner.generator)):
            other.requires_grad_(False)
            accelerator.backward(model(noise, real, which))
            if which == "generator":
                accelerator.clip_grad_norm_(inner.generator.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
            other.requires_grad_(True)


def weights(accelerator, model) -> dict:
    state = accelerator.get_state_dict(model)
    return to_lists(state) if rank() == 0 else {}


def main() -> None:
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    results = {}
    for name, kind in (("ddp", "ddp"), ("zero2", {"stage": 2, "reduce_bucket_size": 300}),
                       ("zero3", {"stage": 3, "param_persistence_threshold": 0})):
        accelerator, model, opt_g, opt_d, loader = start(kind)
        for _ in range(2):
            train_epoch(accelerator, model, opt_g, opt_d, loader)
        results[name] = weights(accelerator, model)
    zero3 = {"stage": 3, "param_persistence_threshold": 0}
    accelerator, model, opt_g, opt_d, loader = start(zero3)
    train_epoch(accelerator, model, opt_g, opt_d, loader)
    accelerator.save_state(work / "zero3")
    accelerator, model, opt_g, opt_d, loader = start(zero3, seed=5)
    accelerator.load_state(work / "zero3")
    train_epoch(accelerator, model, opt_g, opt_d, loader)
    results["zero3_resumed"] = weights(accelerator, model)
    if rank() == 0:
        export_accelerate_state(work / "zero3", work / "exported")
    accelerator.wait_for_everyone()
    accelerator, model, opt_g, opt_d, loader = start("ddp", seed=5)
    accelerator.load_state(work / "exported")
    train_epoch(accelerator, model, opt_g, opt_d, loader)
    results["ddp_from_exported"] = weights(accelerator, model)
    write_json(out, results)


if __name__ == "__main__":
    main()
