"""An ordinary Hugging Face ``Trainer`` script: nothing in it knows about ZeRO.

    accelerate launch --config_file cfg.yaml [-m accelerate_zero.swap] hf_trainer.py OUT_DIR [OTHER_CHECKPOINT]

A tiny GPT-2 (built from a config, no download) trains on generated tokens with gradient accumulation,
clipping, a warmup + linear schedule and a ``save_steps`` checkpoint halfway, then ``save_model`` writes the
final weights to ``OUT_DIR/full/final``. A second ``Trainer`` (a fresh model, another output directory) resumes
from that halfway checkpoint and saves to ``OUT_DIR/resumed/final``. Rank 0 writes ``OUT_DIR/result.json``:
both runs' logged losses, gradient norms and learning rates, and the files of the halfway checkpoint. With
OTHER_CHECKPOINT (a checkpoint written by another launch, e.g. under DDP), a third Trainer resumes from it and
saves to ``OUT_DIR/from_other/final``. Last, a Trainer that evaluates every 2 steps with
``load_best_model_at_end`` saves to ``OUT_DIR/best/final``.
"""

import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

STEPS, SAVE_AT, SEQ, VOCAB = 8, 4, 8, 64


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank and in every run (a fixed generator)."""

    def __init__(self, count: int = 64, seed: int = 1):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def arguments(output_dir: Path, **overrides) -> TrainingArguments:
    return TrainingArguments(**{**dict(
        output_dir=str(output_dir), max_steps=STEPS, save_steps=SAVE_AT, save_strategy="steps",
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, report_to=[], seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True,
    ), **overrides})


def best_of_evaluations(out: Path) -> Trainer:
    """Evaluate every 2 steps and load the best checkpoint at the end. "Best" is the highest eval loss, so that
    it is an early checkpoint and loading it visibly changes the weights."""
    args = arguments(out, save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                     metric_for_best_model="eval_loss", greater_is_better=True, per_device_eval_batch_size=4)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(16, seed=2))
    trainer.train()
    trainer.save_model(str(out / "final"))
    return trainer


def logged(trainer: Trainer) -> dict:
    """Per step: the loss, the gradient norm before clipping and the learning rate, as Trainer logged them."""
    entries = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in entries] for key in ("loss", "grad_norm", "learning_rate")}


def main(out: Path, other: Optional[Path] = None) -> None:
    full = Trainer(model=tiny_gpt2(), args=arguments(out / "full"), train_dataset=Tokens())
    full.train()
    full.save_model(str(out / "full" / "final"))
    checkpoint = out / "full" / f"checkpoint-{SAVE_AT}"

    resumed = Trainer(model=tiny_gpt2(), args=arguments(out / "resumed"), train_dataset=Tokens())
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.save_model(str(out / "resumed" / "final"))

    if other is not None:
        from_other = Trainer(model=tiny_gpt2(), args=arguments(out / "from_other"), train_dataset=Tokens())
        from_other.train(resume_from_checkpoint=str(other))
        from_other.save_model(str(out / "from_other" / "final"))

    best = best_of_evaluations(out / "best")

    if full.args.process_index == 0:
        result = {
            "accelerator": type(full.accelerator).__name__,
            "world_size": full.args.world_size,
            "log": logged(full),
            "resumed_log": logged(resumed),
            "eval_losses": [e["eval_loss"] for e in best.state.log_history if "eval_loss" in e],
            "best_checkpoint": Path(best.state.best_model_checkpoint).name,
            "checkpoint_files": sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()),
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
