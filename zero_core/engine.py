"""The ZeRO engine that both front-ends drive: ``zero_core.setup(model, optimizer, config)``.

The stage is a policy, not a second engine: a *runtime* decides where parameters and gradients live
(stage12.py: whole parameters, sharded gradients in stage 2; stage3.py: partitioned parameters gathered by
hooks). Everything else — loss scaling, clipping by the global norm, the sharded optimizer step over fp32
master shards, statistics — is here, once. docs/core-api.md is the user's guide.
"""

from __future__ import annotations

import contextlib
import os
import math
import warnings
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import registry
from .comm import Communicator
from .config import ZeroConfig
from .fragments import Fragment
from .loss_scaler import LossScaler
from .memory import model_state_bytes
from .mixed_precision import cast_buffers, cast_floating_inputs, cast_module
from .sharded_optimizer import ShardedOptimizer, narrow_param_groups
from .stage12 import ReplicatedParamsRuntime
from .topology import Topology

ConfigLike = Union[ZeroConfig, dict, str, "os.PathLike[str]", None]


def _runtime_class(stage: int):
    if stage == 3:
        from .stage3 import PartitionedParamsRuntime

        return PartitionedParamsRuntime
    return ReplicatedParamsRuntime


class ZeroEngine:
    """A model and its optimizer under ZeRO. Build it with :func:`zero_core.setup`."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig, topology: Topology):
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = Communicator(topology)
        self.skipped_steps = 0
        self._clip_coef: Optional[torch.Tensor] = None
        self._reduced = False
        self._no_sync_depth = 0
        self._scaler = LossScaler.from_fp16_config(config.fp16) if config.fp16.enabled else None
        if config.param_dtype != torch.float32:
            # stage 3 casts each unit as it partitions it: a whole-model cast would touch partitioned parameters
            (cast_buffers if config.stage == 3 else cast_module)(module, config.param_dtype)
        if config.fp16.enabled and config.fp16.auto_cast:
            module.register_forward_pre_hook(cast_floating_inputs(config.param_dtype), with_kwargs=True)
        self._names = {param: name for name, param in module.named_parameters()}
        self.group_param_names = [[self._names[p] for p in g["params"]] for g in optimizer.param_groups]
        trainable = self._trainable_by_group(optimizer)
        self.runtime = _runtime_class(config.stage)(module, trainable, self._names, config, self.comm)
        registry.register(self.runtime.managed_params(), self)
        # Like a torch optimizer skipping parameters whose .grad is None, a step with no backward since the
        # last zero_grad changes nothing (no weight decay, no moment update).
        self._saw_grad = False
        for param in self.runtime.managed_params():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._note_grad)
        masters = [[m for part in self.runtime.parts if part.group_index == i for m in part.masters]
                   for i in range(len(optimizer.param_groups))]
        narrow_param_groups(optimizer, masters)
        self.optimizer = ShardedOptimizer(optimizer, self._step, self.zero_grad)
        self.comm.reset()  # setup's broadcasts and gathers are not training traffic

    # -- setup ---------------------------------------------------------------------------------------------
    def _trainable_by_group(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        """Each optimizer group's trainable parameters, checked to belong to the model."""
        by_group, seen = [], set()
        for index, group in enumerate(optimizer.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for param in trainable:
                if param not in self._names:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                        "in the model passed to zero_core.setup; build the optimizer from model.parameters()"
                    )
                seen.add(param)
            by_group.append(trainable)
        orphans = [n for p, n in self._names.items() if p.requires_grad and p not in seen]
        if orphans:
            warnings.warn(
                f"these trainable parameters are in no optimizer group, so ZeRO neither reduces nor updates them: "
                f"{', '.join(orphans)}. Add them to the optimizer or set requires_grad=False.",
                stacklevel=3,
            )
        return by_group

    @property
    def device(self) -> torch.device:
        parts = self.runtime.parts
        return parts[0].device if parts else torch.device("cpu")

    # -- training ------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    @property
    def loss_scaler(self) -> Optional[LossScaler]:
        """The fp16 loss scaler (``state_dict``/``load_state_dict`` for checkpoints), or None."""
        return self._scaler

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, with the fp16 loss scale applied."""
        (loss * self.loss_scale if self._scaler is not None else loss).backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, until the next backward outside this context."""
        self._no_sync_depth += 1
        self.runtime.set_sync(False)
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self.runtime.set_sync(self._no_sync_depth == 0)

    def _note_grad(self, param: torch.Tensor) -> None:
        if self._reduced and self._averages_whole_grads() and self._clip_coef is None:
            self._reduced = False  # averaged gradients plus new local ones average again to the right sum
        elif self._reduced:
            raise RuntimeError(
                f"a backward produced a gradient for '{self._names.get(param, '?')}' after this step's gradients were "
                "already reduced (by clip_grad_norm_, reduce_gradients or a safe_get_full_grad call), so it would be "
                "lost: run every backward of the step first, then clip, then step()"
            )
        self._saw_grad = True

    def reduce_gradients(self) -> None:
        """Reduce pending gradients now (stage 1 otherwise waits for clipping or the step). A collective."""
        if not self._reduced:
            self.runtime.reduce_gradients()
            self._reduced = True

    def _grad_shards(self) -> list[torch.Tensor]:
        return [s for part in self.runtime.parts for s in part.grad_shards()]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (each element counted once); returns that norm."""
        self.reduce_gradients()
        norm = self._global_norm(float(norm_type))
        self._clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    def _global_norm(self, norm_type: float) -> torch.Tensor:
        shards = [s.float() for s in self._grad_shards()]
        local = torch.zeros((), device=self.device)
        if math.isinf(norm_type):
            for shard in shards:
                local = torch.maximum(local, shard.abs().max()) if shard.numel() else local
            self.comm.all_reduce(local, op=dist.ReduceOp.MAX)
            return local / self.loss_scale
        for shard in shards:
            local = local + shard.abs().pow(norm_type).sum()
        self.comm.all_reduce(local)
        return local.pow(1.0 / norm_type) / self.loss_scale

    def _overflow_on_any_rank(self) -> bool:
        if self._scaler is None:
            return False
        local = torch.zeros((), device=self.device)
        if any(not torch.isfinite(shard).all() for shard in self._grad_shards()):
            local.fill_(1.0)
        self.comm.all_reduce(local, op=dist.ReduceOp.MAX)
        return bool(local.item())

    def step(self) -> None:
        """Sharded optimizer step over the fp32 masters, then the parameters are refreshed; grads are zeroed."""
        self.optimizer.step()  # through the facade, so an LR scheduler built on it sees the step

    def _step(self) -> None:
        if not self._saw_grad:
            self.zero_grad()  # nothing to apply: every rank ran the same (empty) step
            return
        self.reduce_gradients()
        if self._overflow_on_any_rank():
            self.skipped_steps += 1
            self._scaler.update(overflow=True)
            self.zero_grad()
            return
        if self._clip_coef is None and self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping)
        self._attach_master_grads()
        self.optimizer.inner.step()
        for part in self.runtime.parts:
            for master in part.masters:
                master.grad = None
        self.runtime.after_step()
        if self._scaler is not None:
            self._scaler.update(overflow=False)
        self._finish_step()

    def _averages_whole_grads(self) -> bool:
        """Stage 1 with ``reduce_scatter: false`` all-reduces whole gradients, exactly as DDP does."""
        return self.config.stage == 1 and not self.config.reduce_scatter

    @property
    def step_zeroes_grads(self) -> bool:
        """Whether ``step()`` consumes the gradients (DeepSpeed's rule) or leaves them for ``zero_grad()``."""
        return not self._averages_whole_grads()

    def _finish_step(self) -> None:
        """Gradients are consumed, as DeepSpeed's step does; except when they are averaged whole like DDP's
        (see ``_averages_whole_grads``): then, like a torch optimizer, the step leaves them for ``zero_grad()``."""
        if not self.step_zeroes_grads:
            self._clip_coef, self._reduced, self._saw_grad = None, False, False
        else:
            self.zero_grad()

    def _attach_master_grads(self) -> None:
        """Give each master shard its gradient in fp32, unscaled and clipped."""
        inv_scale = 1.0 / self.loss_scale
        for part in self.runtime.parts:
            for master, grad in zip(part.masters, part.grad_shards()):
                if grad.dtype != master.dtype:
                    grad = grad.to(master.dtype)
                if inv_scale != 1.0:
                    grad.mul_(inv_scale)
                if self._clip_coef is not None:
                    grad.mul_(self._clip_coef)
                master.grad = grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient: the shards, stage 1's full buffers, and unmanaged parameters' ``.grad``."""
        self.runtime.zero_grads()
        managed = {id(p) for p in self.runtime.managed_params()}
        for param in self.module.parameters():
            if id(param) not in managed:
                param.grad = None
        self._clip_coef = None
        self._reduced = False
        self._saw_grad = False

    # -- state access (checkpoints, debugging API) ---------------------------------------------------------
    def fragments(self) -> list[Fragment]:
        """This rank's fp32 master (and gradient) pieces of every trainable parameter; see zero_core.fragments."""
        return [f for part in self.runtime.parts for f in part.fragments()]

    def fragments_of(self, name: str) -> list[Fragment]:
        return [f for f in self.fragments() if f.name == name]

    def name_of(self, param: torch.Tensor) -> str:
        return self._names[param]

    def refresh_params_from_masters(self) -> None:
        """Make the model's parameters equal the fp32 masters again (after masters were loaded). A collective."""
        self.runtime.after_step()

    def replicated_state(self) -> dict[str, torch.Tensor]:
        """Buffers and parameters outside every optimizer group, whole. A collective in stage 3, where frozen
        parameters are partitioned and get gathered (all of them at once) into copies."""
        return self.runtime.replicated_state()

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, one at a time (stage 3 gathers each transiently). Call on every rank."""
        yield from self.runtime.iter_full_params()

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write a new full value into the model's own copy of ``param`` (value given on every rank)."""
        self.runtime.refresh_param(param, value)

    def describe(self, param: torch.Tensor) -> str:
        return self._names.get(param, "<unknown>")

    def gather_params(self, params) -> list:
        """GatheredParameters' entry: gather what is partitioned (stage 3). A collective."""
        return self.runtime.gather_params(params)

    def commit_params(self, params, opened: list, modified: bool) -> None:
        """GatheredParameters' exit: keep modified values (masters included), release what was gathered."""
        self.runtime.commit_params(params, opened, modified)

    def empty_partition_cache(self) -> None:
        """Release every gathered stage 3 parameter that is not in use (no-op for stages 1 and 2)."""
        release = getattr(self.runtime, "release_all", None)
        if release is not None:
            release()

    # -- checkpoints (zero_core.checkpoint; every rank calls these) -----------------------------------------
    def save_checkpoint(self, path, client_state: Optional[dict] = None):
        """Write a sharded checkpoint directory atomically (docs/checkpoints.md)."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, path, client_state)

    def load_checkpoint(self, path, strict: bool = True, load_optimizer_states: bool = True) -> Optional[dict]:
        """Load a checkpoint saved at any world size and stage (or a plain state dict); returns client_state."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, path, strict=strict, load_optimizer_states=load_optimizer_states)

    def save_16bit_model(self, out_dir, **kwargs) -> bool:
        """16-bit safetensors of the whole model, streamed one parameter (unit) at a time."""
        from .checkpoint import save_16bit_model

        return save_16bit_model(self, out_dir, **kwargs)

    # -- introspection -------------------------------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes per collective since the last :meth:`reset_comm_stats`."""
        stats = {name: {"calls": 0, "elements": 0, "bytes": 0} for name in ("reduce_scatter", "all_gather", "all_reduce")}
        stats.update(self.comm.stats())
        return stats

    def reset_comm_stats(self) -> None:
        self.comm.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held on this rank now: params, grads, fp32_master, optimizer_state, buffers."""
        return model_state_bytes(self.module, self.optimizer.inner, self.runtime)


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ConfigLike = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> ZeroEngine:
    """Put ``model`` and ``optimizer`` under ZeRO; ``config`` is a ZeroConfig, a dict, a JSON/YAML path or None."""
    config = ZeroConfig.coerce(config)
    if config.auto_fields:
        config = config.resolve_auto()  # front-ends resolve "auto" from their run first; the rest is reported
    if config.stage == 0:
        raise ValueError(
            "zero_optimization.stage=0 disables ZeRO: use torch's DistributedDataParallel, or pick stage 1, 2 or 3"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    config.warn_unimplemented()
    return ZeroEngine(model, optimizer, config, Topology.from_process_group(process_group))
