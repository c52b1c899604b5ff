"""The ZeRO engine that both front-ends drive: ``zero_core.setup(model, optimizer, config)``.

The stage is a policy of this one engine: stage 1 keeps full gradients and reduces them once per step; stage 2
reduces buckets during backward into partitioned gradient shards. Both shard the fp32 master weights and the
optimizer state, and all-gather updated parameters after the step. docs/core-api.md is the user's guide.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .buffer_pool import BufferPool
from .comm import Communicator
from .config import ZeroConfig
from .flat_param_group import FlatParamGroup
from .fragments import Fragment
from .grad_reducer import GradReducer
from .layout import compute_layout
from . import registry
from .loss_scaler import LossScaler
from .memory import model_state_bytes
from .mixed_precision import cast_floating_inputs, cast_module
from .sharded_optimizer import ShardedOptimizer, narrow_param_groups
from .topology import Topology

ConfigLike = Union[ZeroConfig, dict, str, "os.PathLike[str]", None]


class ZeroEngine:
    """A model and its optimizer under ZeRO stage 1 or 2. Build it with :func:`zero_core.setup`."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, config: ZeroConfig, topology: Topology):
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = Communicator(topology)
        self.skipped_steps = 0
        self._clip_coef: Optional[torch.Tensor] = None
        self._reduced = False
        self._sync_context_depth = 0
        self._scaler = LossScaler.from_fp16_config(config.fp16) if config.fp16.enabled else None
        if config.param_dtype != torch.float32:
            cast_module(module, config.param_dtype)
        if config.fp16.enabled and config.fp16.auto_cast:
            module.register_forward_pre_hook(cast_floating_inputs(config.param_dtype), with_kwargs=True)
        self._names = {param: name for name, param in module.named_parameters()}
        self.group_param_names = [[self._names[p] for p in g["params"]] for g in optimizer.param_groups]
        self.groups = self._build_groups(optimizer)
        registry.register([p for g in self.groups for p in g.params], self)
        self._broadcast_initial_state()
        masters = [[m for g in self.groups if g.group_index == i for m in g.build_masters(torch.float32)]
                   for i in range(len(optimizer.param_groups))]
        narrow_param_groups(optimizer, masters)
        self.optimizer = ShardedOptimizer(optimizer, self.step, self.zero_grad)
        self.pool = BufferPool(self._device(), capacity=self._largest_bucket())
        self.reducer = GradReducer(
            self.groups,
            self.comm,
            self.pool,
            partition_grads=config.stage >= 2,
            overlap=config.resolved_overlap_comm,
            use_reduce_scatter=config.reduce_scatter,
            ignore_unused=config.ignore_unused_parameters,
        )
        self.comm.reset()  # the initial broadcast is setup, not training traffic

    # -- setup ---------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def _largest_bucket(self) -> int:
        return max((b.range.size for g in self.groups for b in g.layout.buckets), default=1)

    def _build_groups(self, optimizer: torch.optim.Optimizer) -> list[FlatParamGroup]:
        names = self._names
        bucket_numel = min(self.config.reduce_bucket_size, self.config.allgather_bucket_size)
        groups, seen = [], set()
        for index, group in enumerate(optimizer.param_groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for param in trainable:
                if param not in names:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                        "in the model passed to zero_core.setup; build the optimizer from model.parameters()"
                    )
                seen.add(param)
            for dtype in sorted({p.dtype for p in trainable}, key=str):
                members = [p for p in trainable if p.dtype == dtype]
                layout = compute_layout([p.numel() for p in members], self.topology.world_size, bucket_numel)
                groups.append(FlatParamGroup(members, [names[p] for p in members], index, layout,
                                             self.topology.rank, full_grads=self.config.stage == 1))
        self._warn_unoptimized([n for p, n in names.items() if p.requires_grad and p not in seen])
        return groups

    @staticmethod
    def _warn_unoptimized(names: list[str]) -> None:
        if names:
            warnings.warn(
                f"these trainable parameters are in no optimizer group, so ZeRO neither reduces nor updates them: "
                f"{', '.join(names)}. Add them to the optimizer or set requires_grad=False.",
                stacklevel=3,
            )

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's weights and buffers, as DDP does."""
        managed = {id(p) for g in self.groups for p in g.params}
        tensors = [g.flat for g in self.groups]
        tensors += [p.data for p in self.module.parameters() if id(p) not in managed]
        tensors += list(self.module.buffers())
        for tensor in tensors:
            self.comm.broadcast(tensor, src=0)

    # -- training ------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, with the fp16 loss scale applied."""
        (loss * self.loss_scale if self._scaler is not None else loss).backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication, until the next backward outside this context."""
        self._sync_context_depth += 1
        self.reducer.sync = False
        try:
            yield
        finally:
            self._sync_context_depth -= 1
            self.reducer.sync = self._sync_context_depth == 0

    def _ensure_reduced(self) -> None:
        if self._reduced:
            return
        if self.config.stage == 1:
            self.reducer.reduce_full_grads()
        else:
            self.reducer.flush_unsynced()
        self._reduced = True

    def _grad_shards(self) -> list[torch.Tensor]:
        return [s for g in self.groups for s in g.grad_shards()]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (each element counted once); returns that norm."""
        self._ensure_reduced()
        norm = self._global_norm(float(norm_type))
        self._clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return norm

    def _global_norm(self, norm_type: float) -> torch.Tensor:
        shards = [s.float() for s in self._grad_shards()]
        device = self._device()
        if math.isinf(norm_type):
            local = torch.stack([s.abs().max() for s in shards]).max() if shards else torch.zeros((), device=device)
            self.comm.all_reduce(local, op=dist.ReduceOp.MAX)
            return local / self.loss_scale
        local = sum((s.abs().pow(norm_type).sum() for s in shards), torch.zeros((), device=device))
        self.comm.all_reduce(local)
        return local.pow(1.0 / norm_type) / self.loss_scale

    def _overflow_on_any_rank(self) -> bool:
        if self._scaler is None:
            return False
        local = torch.zeros((), device=self._device())
        for shard in self._grad_shards():
            if not torch.isfinite(shard).all():
                local.fill_(1.0)
                break
        self.comm.all_reduce(local, op=dist.ReduceOp.MAX)
        return bool(local.item())

    def step(self) -> None:
        """Sharded optimizer step, then all-gather of the updated parameters; gradients are zeroed after."""
        self._ensure_reduced()
        if self._overflow_on_any_rank():
            self.skipped_steps += 1
            self._scaler.update(overflow=True)
            self.zero_grad()
            return
        if self._clip_coef is None and self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping)
        self._attach_master_grads()
        self.optimizer.inner.step()
        self._detach_master_grads()
        self._all_gather_params()
        if self._scaler is not None:
            self._scaler.update(overflow=False)
        self.zero_grad()

    def _attach_master_grads(self) -> None:
        """Give each master shard its gradient in fp32, unscaled and clipped."""
        factor = self._clip_coef if self._clip_coef is not None else None
        inv_scale = 1.0 / self.loss_scale
        for group in self.groups:
            for bucket, master in enumerate(group.masters):
                grad = group.grad_shard(bucket)
                if grad.dtype != master.dtype:
                    grad = grad.to(master.dtype)
                if inv_scale != 1.0:
                    grad.mul_(inv_scale)
                if factor is not None:
                    grad.mul_(factor)
                master.grad = grad

    def _detach_master_grads(self) -> None:
        for group in self.groups:
            for master in group.masters:
                master.grad = None

    def _all_gather_params(self) -> None:
        works = []
        for group in self.groups:
            group.write_back_masters()
            for bucket in group.layout.buckets:
                works += self._gather_bucket(group, bucket)
        for work in works:
            work.wait()

    def _gather_bucket(self, group: FlatParamGroup, bucket) -> list:
        full = group.flat[bucket.range.as_slice()]
        if not self.config.allgather_partitions:
            return [self.comm.broadcast(full[bucket.shard_range(r).shift(-bucket.range.start).as_slice()], src=r,
                                        async_op=True) for r in range(self.topology.world_size)]
        own = group.shard_of_params(bucket.index)
        return [self.comm.all_gather(full, own, async_op=True)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient: the shards, stage 1's full buffers, and unmanaged parameters' ``.grad``."""
        for group in self.groups:
            group.zero_grads()
        managed = {id(p) for g in self.groups for p in g.params}
        for param in self.module.parameters():
            if id(param) not in managed:
                param.grad = None
        self._clip_coef = None
        self._reduced = False

    # -- introspection -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device()

    def fragments(self) -> list[Fragment]:
        """This rank's fp32 master (and gradient) pieces of every trainable parameter; see zero_core.fragments."""
        return [f for group in self.groups for f in group.fragments()]

    def fragments_of(self, name: str) -> list[Fragment]:
        return [f for f in self.fragments() if f.name == name]

    def name_of(self, param: torch.Tensor) -> str:
        return self._names[param]

    def reduce_gradients(self) -> None:
        """Reduce pending gradients now (stage 1 otherwise waits for clipping or the step). A collective."""
        self._ensure_reduced()

    @property
    def loss_scaler(self) -> Optional[LossScaler]:
        """The fp16 loss scaler (``state_dict``/``load_state_dict`` for checkpoints), or None."""
        return self._scaler

    def refresh_params_from_masters(self) -> None:
        """Make the model's parameters equal to the fp32 masters again (after masters were loaded). A collective."""
        self._all_gather_params()

    def replicated_state(self) -> dict[str, torch.Tensor]:
        """Model state that ZeRO does not shard: buffers and parameters outside every optimizer group."""
        managed = {id(p) for g in self.groups for p in g.params}
        state = {n: p for n, p in self.module.named_parameters() if id(p) not in managed}
        state.update(dict(self.module.named_buffers()))
        return state

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, one at a time (stage 3 gathers each transiently). Call on every rank."""
        yield from self.module.named_parameters()

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write a new full value into the model's own copy of ``param`` (every rank holds it whole)."""
        with torch.no_grad():
            param.copy_(value.to(param.dtype))

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes per collective since the last :meth:`reset_comm_stats`."""
        stats = {name: {"calls": 0, "elements": 0, "bytes": 0} for name in ("reduce_scatter", "all_gather", "all_reduce")}
        stats.update(self.comm.stats())
        return stats

    def reset_comm_stats(self) -> None:
        self.comm.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held on this rank now: params, grads, fp32_master, optimizer_state, buffers."""
        return model_state_bytes(self.module, self.optimizer.inner, self.groups, self.pool)


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ConfigLike = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> ZeroEngine:
    """Put ``model`` and ``optimizer`` under ZeRO; ``config`` is a ZeroConfig, a dict, a JSON/YAML path or None."""
    config = ZeroConfig.coerce(config)
    if config.stage not in (1, 2):
        raise NotImplementedError(
            f"zero_optimization.stage={config.stage} is not supported by this version of zero_core: use stage 1 or 2"
            + (" (stage 0 is plain data parallelism: use DistributedDataParallel)" if config.stage == 0 else "")
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    config.warn_unimplemented()
    return ZeroEngine(model, optimizer, config, Topology.from_process_group(process_group))
