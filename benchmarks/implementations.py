"""One small function per implementation; each wraps the same model and AdamW into a `Trained` object.

Every implementation: fp32, AdamW with the same hyper-parameters, gradients averaged over ranks, buckets of
``spec.bucket_numel`` elements where the implementation has buckets (DDP's ``bucket_cap_mb`` is the same size
in bytes). A step is ``forward_backward(batch)`` then ``step()``; the worker measures model states between the
two on the last step, when gradients, parameters and optimizer state all exist (DeepSpeed frees its gradient
partitions inside ``step()``). Gradients are cleared at the start of ``forward_backward``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .counting import allreduce_comm_hook
from .measure import StorageCounter, grad_tensors, optimizer_state_tensors, parameter_tensors, reachable_tensors


@dataclass
class Trained:
    """What the worker drives: ``forward_backward(batch) -> loss``, ``step()``, and the model states it measures."""

    forward_backward: Callable[[tuple], torch.Tensor]
    step: Callable[[], None]
    memory: Callable[[], dict]
    engine: Optional[object] = None  # our ZeroEngine, for its own comm and memory counters


def _adamw(params, spec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def _plain_memory(module: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], dict]:
    def measure() -> dict:
        counter = StorageCounter()
        counter.add("params", parameter_tensors(module))
        counter.add("grads", grad_tensors(module))
        counter.add("optimizer_state", optimizer_state_tensors(optimizer))
        counter.add("buffers", module.buffers())
        return counter.bytes

    return measure


def _forward_backward(forward: Callable, backward: Callable, zero_grad: Callable) -> Callable[[tuple], torch.Tensor]:
    compile_backend = _COMPILE["backend"]
    if compile_backend and _COMPILE["mode"] == "whole":  # as the user would: wrapped, then compiled
        forward = torch.compile(forward, backend=compile_backend)

    def run(batch: tuple) -> torch.Tensor:
        zero_grad()
        loss = forward(*batch)
        backward(loss)
        return loss.detach()

    return run


def _nothing() -> None:
    pass


# Set by the worker from RunSpec.compile before an implementation is built ("" = eager). Mode "block": the
# worker compiled each block before the implementation wrapped the model, so the wrapper is not compiled.
_COMPILE = {"backend": "", "mode": "whole"}


def set_compile(backend: str, mode: str = "whole") -> None:
    _COMPILE["backend"], _COMPILE["mode"] = backend, mode


def _ddp(model: nn.Module, spec):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # gradient_as_bucket_view: gradients live in DDP's buckets, not in a second copy (DDP's lean setting).
    module = DDP(model, bucket_cap_mb=spec.bucket_numel * 4 / 2**20, gradient_as_bucket_view=True)
    module.register_comm_hook(None, allreduce_comm_hook)
    return module


def ddp(model: nn.Module, spec) -> Trained:
    module = _ddp(model, spec)
    opt = _adamw(module.parameters(), spec)
    zero_grad = functools.partial(opt.zero_grad, set_to_none=True)
    return Trained(_forward_backward(module, torch.Tensor.backward, zero_grad), opt.step, _plain_memory(model, opt))


def torch_zero(model: nn.Module, spec) -> Trained:
    """torch's ZeroRedundancyOptimizer (optimizer state sharded by whole parameters) under DDP."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module = _ddp(model, spec)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                  weight_decay=spec.weight_decay)
    zero_grad = functools.partial(opt.zero_grad, set_to_none=True)
    return Trained(_forward_backward(module, torch.Tensor.backward, zero_grad), opt.step,
                   _plain_memory(model, opt.optim))


def fsdp2(model: nn.Module, spec) -> Trained:
    """FSDP2: one group per transformer block plus the root; parameters resharded after forward (ZeRO-3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=spec.fsdp_reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=spec.fsdp_reshard_after_forward)
    opt = _adamw(model.parameters(), spec)
    zero_grad = functools.partial(opt.zero_grad, set_to_none=True)
    return Trained(_forward_backward(model, torch.Tensor.backward, zero_grad), opt.step, _plain_memory(model, opt))


def zero(stage: int) -> Callable:
    """Our engine at ``stage``; raises NotImplementedError where the stage does not exist yet."""

    def build(model: nn.Module, spec) -> Trained:
        import zero_core

        config = {"stage": stage, "reduce_bucket_size": spec.bucket_numel, "allgather_bucket_size": spec.bucket_numel,
                  "overlap_comm": spec.overlap_comm, **spec.zero_config}
        engine = zero_core.setup(model, _adamw(model.parameters(), spec), config)
        module = getattr(engine, "module", model)
        # The engine zeroes gradients inside step() and keeps their storage, so there is nothing to clear.
        return Trained(_forward_backward(module, engine.backward, _nothing), engine.step, engine.memory_stats, engine)

    build.__name__ = f"zero{stage}"
    return build


def deepspeed(stage: int) -> Callable:
    """DeepSpeed's ZeRO at ``stage`` on CPU (DS_ACCELERATOR=cpu, gloo), with a plain torch AdamW."""

    def build(model: nn.Module, spec) -> Trained:
        import deepspeed as ds

        zero_block = {"stage": stage, "reduce_bucket_size": spec.bucket_numel,
                      "allgather_bucket_size": spec.bucket_numel, "overlap_comm": spec.overlap_comm}
        if stage == 3:
            zero_block["stage3_prefetch_bucket_size"] = spec.bucket_numel
        # DeepSpeed clips gradients to norm 1.0 unless told otherwise; nothing else here clips.
        config = {"train_micro_batch_size_per_gpu": spec.model.batch_size, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 0.0, "zero_optimization": zero_block, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9}
        engine, _, _, _ = ds.initialize(model=model, optimizer=_adamw(model.parameters(), spec), config=config)
        return Trained(_forward_backward(engine, engine.backward, _nothing), engine.step, _deepspeed_memory(engine))

    build.__name__ = f"deepspeed{stage}"
    return build


def _deepspeed_memory(engine) -> Callable[[], dict]:
    """Parameters, gradients and AdamW state as for the others, then what DeepSpeed's optimizer holds besides:
    its fp32 partitions count as fp32 master, gradient partitions and buckets as gradients, the rest as other."""

    def measure() -> dict:
        zero_opt = engine.optimizer
        counter = StorageCounter()
        counter.add("params", parameter_tensors(engine.module))
        counter.add("grads", grad_tensors(engine.module))
        counter.add("optimizer_state", optimizer_state_tensors(zero_opt.optimizer))
        for path, tensor in reachable_tensors(zero_opt):
            name = path.lower()
            cls = "fp32_master" if "fp32" in name else "grads" if "grad" in name else "buffers"
            counter.add(cls, [tensor])
        counter.add("buffers", engine.module.buffers())
        return counter.bytes

    return measure


IMPLEMENTATIONS: dict[str, Callable] = {
    "ddp": ddp,
    "torch_zero": torch_zero,
    "fsdp2": fsdp2,
    "zero1": zero(1),
    "zero2": zero(2),
    "zero3": zero(3),
    "deepspeed1": deepspeed(1),
    "deepspeed2": deepspeed(2),
    "deepspeed3": deepspeed(3),
}

LABELS = {
    "ddp": "DDP", "torch_zero": "torch ZeroRedundancyOptimizer + DDP", "fsdp2": "FSDP2 (fully_shard)",
    "zero1": "lightning-zero stage 1", "zero2": "lightning-zero stage 2", "zero3": "lightning-zero stage 3",
    "deepspeed1": "DeepSpeed stage 1", "deepspeed2": "DeepSpeed stage 2", "deepspeed3": "DeepSpeed stage 3",
}

# The paper's stage of each implementation (0 = plain data parallelism), for the formula columns.
STAGE_OF = {"ddp": 0, "torch_zero": 1, "fsdp2": 3, "zero1": 1, "zero2": 2, "zero3": 3,
            "deepspeed1": 1, "deepspeed2": 2, "deepspeed3": 3}
