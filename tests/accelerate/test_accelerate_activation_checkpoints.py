"""Accelerate's activation-checkpointing switch is Hugging Face's ``gradient_checkpointing_enable()`` (its FSDP
plugin, the other one, is refused by ZeroAccelerator): with the config's ``cpu_checkpointing`` it goes through
``zero_core.checkpointing.checkpoint`` at stage 3 (full partitioning) and trains to the weights of the same model
trained plainly with Hugging Face's checkpointing. One process (the multi-rank parity of the same routing is
tests/core/test_activation_checkpoints.py's)."""

from __future__ import annotations

import torch

from accelerate_zero import ZeroAccelerator, ZeroPlugin
from init_safety_models import GPT2LM
from models import transformer_batch
from zero_core import checkpointing

STEPS = 2
CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "activation_checkpointing": {"cpu_checkpointing": True}}


def _model():
    model = GPT2LM()
    model.lm.gradient_checkpointing_enable()
    return model


def test_hf_gradient_checkpointing_with_cpu_checkpointing_trains_to_the_plain_weights():
    plain = _model()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for step in range(STEPS):
        plain(*transformer_batch(0, step, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    accelerator = ZeroAccelerator(cpu=True, zero_plugin=ZeroPlugin(config=CONFIG))
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for step in range(STEPS):
        accelerator.backward(model(*transformer_batch(0, step, 0)))
        optimizer.step()
        optimizer.zero_grad()
    stats = checkpointing.current().stats  # the two GPT-2 blocks' inputs waited in host memory each step
    assert stats.stashed == stats.restored == 2 * STEPS and stats.host_bytes > 0
    got = accelerator.get_state_dict(model)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name].float(), value.float(), rtol=0, atol=2e-6, msg=name)
    accelerator.end_training()
    checkpointing.configure()
