"""A forward installed on the model instance (TRL's fused LM head, a user's patch) under every mode.

    accelerate launch --config_file cfg.yaml patched_forward.py OUT.json

A tiny language model gets, before or after ``prepare``, an instance ``forward`` built as TRL's
``add_fused_lm_head`` builds it (``functools.wraps`` of the class's forward, ``lm_head.weight`` read directly,
a marker in its output); after ``prepare`` it replaces the autocast wrapper, as it would on the module inside
DDP. One process group, runs in sequence: plain Accelerate DDP and ``ZeroAccelerator`` at stages 2 and 3, with
Accelerate-style autocast (bf16, also compiled by ``dynamo_backend``), the engine's bf16 and fp32. Rank 0 writes
per run: the weights, whether every forward was the patched one and ran under autocast, and the forward left by
``unwrap_model(keep_fp32_wrapper=False)``.
"""

import functools
import sys
from types import MethodType

import torch
import torch._dynamo
import torch.nn.functional as F

from accelerate_zero import ZeroAccelerator, ZeroPlugin
from common import fresh_state, rank, to_lists, write_json
from tiny_lm import TinyLM as SharedTinyLM, lm_batch

STEPS = 3
STAGE3 = {"stage": 3, "param_persistence_threshold": 0, "max_live_parameters": 100}  # the head gathered on read
RUNS = {  # name: (ZeRO config or None for DDP, autocast, mixed_precision, patch after prepare[, compiled])
    "ddp_autocast": (None, False, "bf16", False),
    "zero2_autocast": ({"stage": 2}, True, "bf16", False),
    "zero3_autocast": (STAGE3, True, "bf16", False),
    "ddp_autocast_after": (None, False, "bf16", True),
    "zero3_autocast_after": (STAGE3, True, "bf16", True),
    "zero3_bf16": (STAGE3, False, "bf16", False),
    "ddp_fp32": (None, False, "no", False),
    "zero3_fp32_after": (STAGE3, False, "no", True),
    "ddp_autocast_compiled": (None, False, "bf16", False, True),
    "zero3_autocast_compiled": (STAGE3, True, "bf16", False, True),
}


class TinyLM(SharedTinyLM):
    """Accelerate-style output: a dict with the loss."""

    def __init__(self):
        super().__init__(final_norm=False)

    def forward(self, tokens, targets):
        return {"loss": super().forward(tokens, targets)}


def add_fused_head(model: TinyLM) -> None:
    """As TRL's ``add_fused_lm_head``: keeps the original forward, wraps the class's signature, reads the head's
    weight without calling the head, and says so in its output."""
    @functools.wraps(type(model).forward)
    def fused(self, tokens, targets):
        logits = F.linear(self.hidden(tokens), self.lm_head.weight)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return {"loss": loss, "fused": True, "autocast": torch.is_autocast_enabled("cpu")}

    model.forward = MethodType(fused, model)


def batch(step: int):
    return lm_batch(step, rank())


def one_run(config, autocast: bool, mixed_precision: str, after: bool, compiled: bool = False) -> dict:
    fresh_state()
    torch._dynamo.reset()
    options = {"mixed_precision": mixed_precision, "dynamo_backend": "aot_eager" if compiled else "no"}
    if config is None:
        from accelerate import Accelerator

        accelerator = Accelerator(**options)
    else:
        accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(config=config, autocast=autocast), **options)
    model = TinyLM()
    if not after:
        add_fused_head(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    if after:
        add_fused_head(accelerator.unwrap_model(prepared))
    fused, autocast_seen = [], []
    for step in range(STEPS):
        out = prepared(*batch(step))
        fused.append(out.get("fused", False))
        autocast_seen.append(out.get("autocast", False))
        accelerator.backward(out["loss"])
        optimizer.step()
        optimizer.zero_grad()
    # plain Accelerate's state dict of a compiled DDP model keeps torch.compile's "_orig_mod." prefix
    state = {k.replace("_orig_mod.", ""): v for k, v in accelerator.get_state_dict(prepared).items()}
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    left = getattr(unwrapped.forward, "__func__", None)
    is_patch = left is not TinyLM.forward and getattr(left, "__wrapped__", None) is TinyLM.forward  # functools.wraps
    result = {"fused": fused, "autocast": autocast_seen, "unwrapped_is_patch": is_patch}
    if rank() == 0:
        result["weights"] = to_lists(state)
    return result


def main() -> None:
    write_json(sys.argv[1], {name: one_run(*spec) for name, spec in RUNS.items()})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
