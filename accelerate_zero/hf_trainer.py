"""Hugging Face ``Trainer`` checkpoints under ZeRO: whole weights from ``save_model``, and exact resumes.

``Trainer`` builds its own ``Accelerator`` (``ZeroAccelerator`` under ``accelerate_zero.swap``) and, for anything
that is neither DeepSpeed nor FSDP, saves as under DDP: ``model.state_dict()`` and ``optimizer.state_dict()``
on rank 0 only, loaded back on every rank. Under ZeRO rank 0 holds one shard of the optimizer state (and at
stage 3 of the weights), so the methods where ``Trainer`` itself branches for DeepSpeed and FSDP are
wrapped, for trainers whose model runs under a ZeRO engine (any other trainer runs the original method):

- ``save_model``: every rank joins ``engine.full_state_dict()`` (the fp32 master weights, as a DDP model holds
  them); rank 0 writes them with ``save_pretrained``, as for DeepSpeed, and ``config.json`` names their dtype
  (fp32; ``save_pretrained`` would name the model's 16-bit one). A PEFT model at stage 3: the trained parameters
  alone (``exclude_frozen_parameters``, what transformers asks DeepSpeed for), so the frozen base is not gathered.
- ``_save_optimizer_and_scheduler``: every rank writes the engine's sharded checkpoint (fp32 masters, optimizer
  state, fp16 loss scale) into ``checkpoint-N/zero_model``, as ``accelerator.save_state`` does (for a PEFT model
  without the frozen base, as transformers saves DeepSpeed's); rank 0 saves the scheduler. No ``optimizer.pt``.
- ``_load_optimizer_and_scheduler``: every rank loads ``zero_model`` (resharding when the world size or stage
  changed), or, from a checkpoint written by plain DDP, the whole ``optimizer.pt`` with ``model.safetensors``;
  then the scheduler.
- ``_load_best_model`` (``load_best_model_at_end``): every rank loads the best checkpoint's weights into the
  engine, fp32 masters included (``model.load_state_dict`` would miss the masters, and at stage 3 the
  partitioned parameters).
- ``_inner_training_loop`` (for any trainer on a ``ZeroAccelerator``, before the model is prepared): resuming
  from a checkpoint saved at another world size first re-plans ``args.gradient_accumulation_steps`` to keep
  the global batch (elastic.py), so the loop plans its epochs, the batches it skips and its steps with it.

Wrapping is process-local (nothing is written to the installed package) and happens when a ``ZeroAccelerator``
is created while ``transformers.trainer`` is imported, which is always the case when a ``Trainer`` creates it.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

_WRAPPED = "_accelerate_zero_wrapped"
SCHEDULER_NAME = "scheduler.pt"
OPTIMIZER_NAME = "optimizer.pt"
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")


def install_if_loaded() -> None:
    """Wrap ``transformers.Trainer``'s checkpoint methods once, if ``transformers.trainer`` is imported."""
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None)
    if trainer is None or getattr(trainer, _WRAPPED, False):
        return
    for name, replacement in (("save_model", save_model), ("_save_optimizer_and_scheduler", save_optimizer),
                              ("_load_optimizer_and_scheduler", load_optimizer), ("_load_best_model", load_best)):
        setattr(trainer, name, _under_zero(getattr(trainer, name), replacement))
    trainer._inner_training_loop = _on_zero_accelerator(trainer._inner_training_loop, training_loop)
    setattr(trainer, _WRAPPED, True)


def _under_zero(original: Callable, replacement: Callable) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        managed = _managed(self)
        if managed is None:
            return original(self, *args, **kwargs)
        return replacement(self, managed, *args, **kwargs)

    return method


def _on_zero_accelerator(original: Callable, replacement: Callable) -> Callable:
    """For methods that run before the model is prepared: the replacement gets the original to call."""
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        from .accelerator import ZeroAccelerator

        if not isinstance(getattr(self, "accelerator", None), ZeroAccelerator):
            return original(self, *args, **kwargs)
        return replacement(self, original, *args, **kwargs)

    return method


def _managed(trainer):
    """The ``ManagedModel`` training ``trainer.model``, or None (not a ZeroAccelerator, or not prepared yet)."""
    from .accelerator import ZeroAccelerator

    accelerator = getattr(trainer, "accelerator", None)
    if not isinstance(accelerator, ZeroAccelerator) or getattr(trainer, "model", None) is None:
        return None
    return accelerator._managed_for(trainer.model)


def save_model(trainer, managed, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    # a collective; {} on other ranks. A LoRA adapter at stage 3: its trained weights alone, as transformers asks
    # DeepSpeed for (save_pretrained keeps the adapter's keys only), so the frozen base is never gathered
    exclude = _is_peft(trainer.model) and managed.engine.config.stage == 3
    state_dict = managed.engine.full_state_dict(rank0_only=True, exclude_frozen_parameters=exclude)
    dtype = _floating_dtype(state_dict)  # before _save: save_pretrained empties the dict as it writes
    trainer._save(output_dir, state_dict=state_dict)
    if trainer.args.should_save and dtype is not None:
        _name_saved_dtype(Path(output_dir), dtype)
    if trainer.args.push_to_hub and not _internal_call:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


def _is_peft(model) -> bool:
    """Whether ``model`` is a PEFT model, by transformers' own test (the one its DeepSpeed branches use)."""
    from transformers.trainer import _is_peft_model

    return _is_peft_model(model)


def _floating_dtype(state_dict: dict) -> Optional[torch.dtype]:
    """The dtype of most floating elements (the masters'; a buffer may differ); None without any."""
    elements: dict = {}
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            elements[tensor.dtype] = elements.get(tensor.dtype, 0) + tensor.numel()
    return max(elements, key=elements.get) if elements else None


def _name_saved_dtype(directory: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` names the model's dtype in config.json (bf16 under the engine's 16-bit training), but
    the weights written are the fp32 masters: name theirs, so ``from_pretrained`` loads what was saved."""
    from zero_core import write_hf_config

    config = directory / "config.json"
    if config.is_file():
        write_hf_config(config, directory, dtype)


def training_loop(trainer, original: Callable, batch_size=None, args=None, resume_from_checkpoint=None,
                  *rest, **kwargs):
    """Resuming at another world size: the accumulation that keeps the checkpoint's global batch, set before
    the loop counts epochs, skipped batches and steps in micro-batches."""
    if resume_from_checkpoint is not None:
        from .elastic import keep_trainer_global_batch
        from .state_io import saved_global_batch

        keep_trainer_global_batch(trainer, saved_global_batch(resume_from_checkpoint))
    return original(trainer, batch_size, args, resume_from_checkpoint, *rest, **kwargs)


def save_optimizer(trainer, managed, output_dir: str) -> None:
    from .elastic import batch_record
    from .state_io import save_engines

    # every rank: zero_model/ and zero_state.json, with the Trainer's accumulation (its Accelerator's is 1)
    save_engines(trainer.accelerator, output_dir,
                 batch_record(trainer.accelerator.num_processes, trainer.args.gradient_accumulation_steps),
                 exclude_frozen_parameters=_is_peft(trainer.model))  # as transformers saves DeepSpeed's, for PEFT
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_optimizer(trainer, managed, checkpoint: Optional[str]) -> None:
    if checkpoint is None:
        return
    directory = Path(checkpoint)
    if (directory / "zero_model").is_dir():
        from .state_io import load_engines

        load_engines(trainer.accelerator, directory)
    elif (directory / OPTIMIZER_NAME).is_file():
        _load_plain(managed.engine, directory)
    else:
        raise FileNotFoundError(
            f"the Trainer checkpoint {directory} has neither a zero_model/ directory (written under ZeRO) nor "
            f"{OPTIMIZER_NAME} (written by DDP), so its optimizer state cannot be restored: resume from a "
            "checkpoint saved with save_only_model=False"
        )
    scheduler = directory / SCHEDULER_NAME
    if scheduler.is_file() and trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def load_best(trainer, managed) -> None:
    """``load_best_model_at_end``: the best checkpoint's weights go into the engine (fp32 masters included, so
    the next ``save_model`` writes them), from its ``zero_model`` or else its ``model.safetensors``."""
    from zero_core import load_checkpoint, load_full_state_dict

    directory = Path(trainer.state.best_model_checkpoint)
    if (directory / "zero_model").is_dir():
        load_checkpoint(managed.engine, directory / "zero_model", load_optimizer_states=False)
    else:
        load_full_state_dict(managed.engine, _model_file(directory))


def _model_file(directory: Path) -> Path:
    found = next((directory / f for f in MODEL_FILES if (directory / f).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"the Trainer checkpoint {directory} has no {' or '.join(MODEL_FILES)}")
    return found


def _load_plain(engine, directory: Path) -> None:
    """A checkpoint written by plain DDP: its whole weights and whole optimizer state, each rank keeping its own
    ranges. A shard written by an earlier ZeRO Trainer (rank 0's only) is refused by the loader."""
    from zero_core import load_full_state_dict

    load_full_state_dict(engine, _model_file(directory), optimizer_state=directory / OPTIMIZER_NAME)
