"""An ordinary Accelerate training loop, run under ZeRO by changing one import.

    accelerate-zero launch --config examples/zero.yaml examples/accelerate_train.py
    accelerate-zero launch --config examples/zero.yaml examples/accelerate_train.py --save-state ckpt --save-at 10
    accelerate-zero launch --config examples/zero.yaml examples/accelerate_train.py --resume-from ckpt
    accelerate-zero launch --config examples/zero.yaml examples/accelerate_train.py --compile inductor

Everything below the import is plain Accelerate: ``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``,
a learning-rate scheduler, ``save_state``/``load_state`` (sharded under ZeRO), ``get_state_dict`` and
``save_model``. The ZeRO stage and settings come from the ``zero_optimization:`` block of zero.yaml.
"""

import argparse

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_zero import ZeroAccelerator as Accelerator  # was: from accelerate import Accelerator

FEATURES, OUTPUTS, SAMPLES = 13, 3, 256


def make_model() -> nn.Module:
    # Odd widths, so ZeRO's flat buffers need padding; a LayerNorm for parameters without weight decay.
    return nn.Sequential(nn.Linear(FEATURES, 31), nn.LayerNorm(31), nn.GELU(), nn.Linear(31, 17), nn.GELU(),
                         nn.Linear(17, OUTPUTS))


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x @ torch.randn(FEATURES, OUTPUTS, generator=g)) + 0.1 * torch.randn(SAMPLES, OUTPUTS, generator=g)
    return TensorDataset(x, y)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def make_scheduler(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps))


class Progress:
    """Optimizer steps done so far; saved by ``save_state`` through ``register_for_checkpointing``."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def train(accelerator, steps: int, batch_size: int = 4, lr: float = 3e-3, max_grad_norm: float = 0.5, seed: int = 0,
          save_state=None, save_at=None, resume_from=None, on_step=None):
    """Train for ``steps`` optimizer steps; returns (model, per-step gradient norms)."""
    set_seed(seed)
    model = make_model()
    optimizer = make_optimizer(model, lr)
    scheduler = make_scheduler(optimizer, steps)
    loader = DataLoader(make_dataset(), batch_size=batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if resume_from:
        accelerator.load_state(resume_from)
    norms, per_epoch = [], len(loader) // accelerator.gradient_accumulation_steps
    epoch, done_in_epoch = divmod(progress.step, per_epoch)
    while progress.step < steps:
        loader.set_epoch(epoch)
        skip = done_in_epoch * accelerator.gradient_accumulation_steps
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.step += 1
                if on_step is not None:
                    on_step(progress.step, loss.item())
                if progress.step == save_at:
                    accelerator.save_state(save_state)
                if progress.step == steps:
                    break
        epoch, done_in_epoch = epoch + 1, 0
    return model, norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--save-state", help="directory for accelerator.save_state")
    parser.add_argument("--save-at", type=int, help="optimizer step after which to save the state")
    parser.add_argument("--resume-from", help="a save_state directory to resume from")
    parser.add_argument("--output", help="directory for accelerator.save_model (safetensors) at the end")
    parser.add_argument("--compile", metavar="BACKEND", help="Accelerate's dynamo_backend (inductor, aot_eager); "
                        "zero.yaml's dynamo_config does the same")
    args = parser.parse_args()
    compile_kwargs = {"dynamo_backend": args.compile} if args.compile else {}  # else Accelerate's own setting
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True), **compile_kwargs)
    model, _ = train(accelerator, args.steps, save_state=args.save_state, save_at=args.save_at,
                     resume_from=args.resume_from,
                     on_step=lambda step, loss: accelerator.print(f"step {step:3d}  loss {loss:.4f}"))
    if args.output:
        accelerator.save_model(model, args.output)
        accelerator.print(f"saved the weights to {args.output}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
