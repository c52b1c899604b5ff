"""The ZeRO engine that both front-ends drive: ``zero_core.setup(model, optimizer, config)``.

The stage is a policy, not a second engine: a *runtime* decides where parameters and gradients live
(stage12.py: whole parameters, sharded gradients in stage 2; stage3.py: partitioned parameters gathered by
hooks). Everything else — loss scaling, clipping by the global norm, the sharded optimizer step over fp32
master shards, statistics — is here, once. docs/core-api.md is the user's guide.
"""

from __future__ import annotations

import contextlib
import functools
import os
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from zero_core import checkpointing, planning, registry, teardown
from zero_core.arg_checks import check_module, check_process_group, described

from zero_core.checkpoint import shard_identity
from zero_core.comm.communicator import CommOptions, Communicator
from zero_core.config import ZeroConfig
from zero_core.fragments import Fragment
from zero_core.grad_notes import GradNotes
from zero_core.stage3.generation import GenerationSession, generate_in_sessions
from zero_core.stage3.leaf_modules import apply_leaf_config
from zero_core.optim.loss_scaler import LossScaler
from zero_core.optim.master_shards import step_in_tiles
from zero_core.optim.weights_ema import WeightsEMA
from zero_core.tools.memory import model_state_bytes
from zero_core.optim.mixed_precision import cast_buffers, cast_floating_inputs, cast_module
from zero_core.offload import adopt as adopt_offload, attach as attach_offload
from zero_core.stage3.partitioned_param import dispatch_gathered, released_params, unguarded
from zero_core.plain_loop import OptimizerRoute
from zero_core.optim.sharded_optimizer import ShardedOptimizer, narrow_param_groups, new_group_params
from zero_core.replicated.runtime import ReplicatedParamsRuntime
from zero_core.comm.topology import Topology
from zero_core.weak_hooks import weakly

ConfigLike = Union[ZeroConfig, dict, str, "os.PathLike[str]", None]
OptimizerRef = Union[int, torch.optim.Optimizer, None]


@dataclass
class _PendingGrads:
    """One optimizer's gradients since its last step or zero_grad."""

    saw_grad: bool = False  # a backward produced a gradient for one of its parameters
    reduced: bool = False  # they were reduced (by clipping, reduce_gradients or the step)
    clip_coef: Optional[torch.Tensor] = None
    used: set = field(default_factory=set)  # ids of the parameters that got a gradient here (on this rank)
    unscaled: bool = False  # a gradient came from a backward outside engine.backward (fp16: not loss-scaled)


def _runtime_class(stage: int):
    if stage == 3:
        from zero_core.stage3.runtime import PartitionedParamsRuntime

        return PartitionedParamsRuntime
    return ReplicatedParamsRuntime


class ZeroEngine:
    """A model and its optimizer under ZeRO. Build it with :func:`zero_core.setup`."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig,
                 topology: Topology):
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = Communicator(topology, CommOptions.from_config(config))
        self.skipped_steps = 0
        self._no_sync_depth = 0
        self._engine_backward = False  # inside engine.backward (which applies the fp16 loss scale)
        self._scaler = LossScaler.from_fp16_config(config.fp16) if config.fp16.enabled else None
        self._scaler_overflow: Optional[bool] = None  # a step's verdict waiting for the other optimizers
        if config.param_dtype != torch.float32:
            # stage 3 casts each unit as it partitions it: a whole-model cast would touch partitioned parameters
            (cast_buffers if config.stage == 3 else cast_module)(module, config.param_dtype)
        if config.fp16.enabled and config.fp16.auto_cast:
            module.register_forward_pre_hook(cast_floating_inputs(config.param_dtype), with_kwargs=True)
        if config.stage == 3:
            leaves = config.leaf_module
            apply_leaf_config(module, leaves.classes, leaves.names, leaves.name_suffixes)
        self._names = {param: name for name, param in module.named_parameters()}
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self._record_groups(groups)
        trainable = self._trainable_by_group(groups)
        self.runtime = _runtime_class(config.stage)(module, trainable, self._names, config, self.comm)
        # offload hook (zero_core/offload): host/NVMe masters replace the runtime's before optimizers bind
        self._offload = attach_offload(self.runtime, config, topology.rank)
        if config.stage == 3:
            generate_in_sessions(module, self)  # Hugging Face generate(): kept gathers, ranks run until all are done
        registry.register(self.runtime.managed_params(), self)
        # The model holds its engines, the registry only weakly: a partitioned model needs its engine for as long as
        # it lives (lookups from its parameters must give every rank the same answer, whenever the cycle collector
        # runs), and a dropped model and engine go together.
        module.__dict__.setdefault("_zero_core_engines", []).append(self)
        # Which parameters got a gradient: each one's hook appends it to a list, with no Python per gradient
        # (grad_notes.py). Stage 2's reducer hooks every trainable parameter already and records it from there;
        # otherwise the engine hooks them itself. Neither the hooks nor the runtime hold the engine.
        self._notes = GradNotes(weakly(self._note_grad))
        weakref.finalize(self, self._notes.arrivals.clear)
        take_notes = getattr(self.runtime, "take_grad_notes", None)
        self._runtime_notes_grads = take_notes is not None and take_notes(self._notes)
        if not self._runtime_notes_grads:
            self._notes.hook(p for p in self.runtime.managed_params() if p.requires_grad)
        self._bind_optimizers(optimizers)
        self.weights_ema = _weights_ema(config, self.runtime.parts)  # None unless weights_ema_decay is set
        self.comm.reset()  # setup's broadcasts and gathers are not training traffic
        teardown.destroy_group_at_exit()  # a group left up at exit is closed while Python still runs
        self._exit_finalizer = teardown.close_at_exit(self, self.runtime)  # for scripts that never call close()

    # -- setup ---------------------------------------------------------------------------------------------
    def _bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Narrow each optimizer to this rank's master shards and give it a facade that steps through here."""
        self.inner_optimizers = list(optimizers)
        if self._offload is not None:  # offload hook: the state it swaps with the masters
            self._offload.bind(self.inner_optimizers)
        self.group_optimizer = [k for k, opt in enumerate(optimizers) for _ in opt.param_groups]
        self._index_parts()
        start = 0
        for optimizer in optimizers:
            indices = range(start, start + len(optimizer.param_groups))
            narrow_param_groups(optimizer, [[m for part in self.runtime.parts if part.group_index == i
                                             for m in part.masters] for i in indices])
            start += len(optimizer.param_groups)
        self.optimizers = [ShardedOptimizer(opt, functools.partial(self._step, k), functools.partial(self._zero, [k]),
                                            functools.partial(self.add_param_group, k))
                           for k, opt in enumerate(optimizers)]
        for k, facade in enumerate(self.optimizers):
            facade.describe_shard = functools.partial(shard_identity.describe, self, k)
        for k, optimizer in enumerate(optimizers):
            # The user's own optimizer object adds groups through the engine too (its groups hold master shards).
            optimizer.add_param_group = functools.partial(self.add_param_group, k)
        # The plain loop: the user's own optimizer.step()/zero_grad() do what the facade's do (plain_loop.py).
        self._routes = [OptimizerRoute(opt, functools.partial(self._user_step, k), functools.partial(self._zero, [k]))
                        for k, opt in enumerate(optimizers)]
        # Like a torch optimizer skipping parameters whose .grad is None, a step with no backward since the
        # last zero_grad changes nothing (no weight decay, no moment update).
        self._pending = [_PendingGrads() for _ in optimizers]

    def _index_parts(self) -> None:
        """Which parts (flat groups, units) each optimizer steps; each trainable parameter's flag slot."""
        self._parts_of = [[part for part in self.runtime.parts if self.group_optimizer[part.group_index] == k]
                          for k in range(len(self.inner_optimizers))]
        self._optimizer_of = {p: k for k, parts in enumerate(self._parts_of) for part in parts for p in part.params}
        self._managed_ids = {id(p) for p in self._optimizer_of}  # per-step membership tests without Tensor.__hash__
        # Each trainable parameter's slot in its optimizer's "got a gradient" flags (No gradient, no step), keyed
        # by id: the per-parameter gradient hook and the step look it up without Tensor.__hash__ (a Python call).
        self._flag_slot = {id(p): i for parts in self._parts_of
                           for i, p in enumerate(p for part in parts for p in part.params)}
        self._optimizer_by_id = {id(p): k for p, k in self._optimizer_of.items()}
        # zero_grad clears these (frozen, in no group, or unfrozen but not adopted yet): listed once here, as
        # walking module.parameters() at every step is Python per module
        self._unmanaged = [p for p in self.module.parameters() if id(p) not in self._managed_ids]
        # Each group's parameters without master shards (frozen when it was set up): the only ones
        # _adopt_trainable has to look at, at every step
        self._unadopted = [[p for p in params if id(p) not in self._managed_ids] for params in self.group_params]

    # -- the trainable set changes (docs/core-api.md, "When the trainable parameters change") --------------
    def add_param_group(self, optimizer: OptimizerRef, param_group: dict) -> None:
        """``optimizer.add_param_group`` after setup: model parameters (frozen at setup, e.g. a backbone being
        unfrozen) join optimizer ``optimizer`` as a new group, with this group's hyper-parameters. Call it on
        every rank, between steps."""
        k = self.optimizer_indices(optimizer)[0]
        params = new_group_params(param_group, self._names, self.group_params)
        insert_at = max(i for i, owner in enumerate(self.group_optimizer) if owner == k) + 1
        for part in self.runtime.parts:
            if part.group_index >= insert_at:
                part.group_index += 1
        self.group_optimizer.insert(insert_at, k)
        self.group_params.insert(insert_at, params)
        self.group_param_names.insert(insert_at, [self._names[p] for p in params])
        inner = self.inner_optimizers[k]
        type(inner).add_param_group(inner, {**param_group, "params": []})  # torch fills in the defaults
        self._index_parts()
        self._adopt_trainable()

    def _adopt_trainable(self) -> None:
        """Parameters of an optimizer group that require a gradient now but did not when their group was set up
        get their master shards here (stage 3: their units become trainable). Every rank runs this at the same
        points (before reducing gradients, and in add_param_group), as requires_grad is the same everywhere."""
        self._settle_notes()
        with unguarded():  # metadata of every parameter, every step: not the user's code the guard watches
            fresh = {i: [p for p in params if p.requires_grad] for i, params in enumerate(self._unadopted) if params}
        fresh = {i: params for i, params in fresh.items() if params}
        if not fresh:
            return
        had_grad = [p for params in fresh.values() for p in params if p.grad is not None]
        new_parts = self.runtime.add_trainable(fresh)
        adopt_offload(self.runtime, new_parts, self.config, self._offload)  # offload hook: they are offloaded too
        new_params = [p for params in fresh.values() for p in params]
        registry.register(new_params, self)
        if not self._runtime_notes_grads:  # else the runtime's new hooks record them
            self._notes.hook(new_params)
        self._index_parts()
        for part in new_parts:
            k = self.group_optimizer[part.group_index]
            local = part.group_index - self.group_optimizer.index(k)
            self.inner_optimizers[k].param_groups[local]["params"].extend(part.masters)
        for param in had_grad:  # a backward ran since they were unfrozen: that gradient counts
            pending = self._pending[self._optimizer_of[param]]
            pending.used.add(id(param))
            pending.saw_grad = True

    def replace_optimizers(self, optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]) -> None:
        """Train on with fresh optimizers (a second ``fit``): the partitioning and the fp32 master weights stay.

        The new optimizers must hold the same trainable parameters in the same groups as the ones given to
        :func:`setup`; their state starts empty. Gradients are cleared.
        """
        optimizers = _as_optimizer_list(optimizers, "ZeroEngine.replace_optimizers")
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        names = [[self._names.get(p, "?") for p in g["params"] if p.requires_grad] for g in groups]
        trainable = {self._names[p] for p in self._optimizer_of}
        before = [[n for n in group if n in trainable] for group in self.group_param_names]
        if names != before:
            raise ValueError(
                "the new optimizers group the trainable parameters differently from the ones this engine was set "
                f"up with ({len(names)} groups, first names {[g[:2] for g in names]}; before: {len(before)} groups, "
                f"{[g[:2] for g in before]}). The engine's flat buffers follow the optimizer groups: build the "
                "optimizers the same way, or set up a fresh model"
            )
        self.zero_grad()
        for route in self._routes:
            route.unroute()
        self._record_groups(groups)
        self._bind_optimizers(optimizers)

    def _record_groups(self, groups: list[dict]) -> None:
        """Each optimizer group's own parameters (frozen ones included), before narrowing to master shards."""
        self.group_params = [list(g["params"]) for g in groups]
        self.group_param_names = [[self._names.get(p, "?") for p in params] for params in self.group_params]

    def _trainable_by_group(self, groups: list[dict]) -> list[list[nn.Parameter]]:
        """Each optimizer group's trainable parameters, checked to belong to the model and to one group only."""
        by_group, seen = [], {}
        for index, group in enumerate(groups):
            trainable = [p for p in group["params"] if p.requires_grad]
            for param in trainable:
                if param not in self._names:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                        "in the model passed to zero_core.setup; build the optimizer from model.parameters()"
                    )
                if param in seen:
                    raise ValueError(
                        f"parameter '{self._names[param]}' is in two optimizer groups ({seen[param]} and {index}, "
                        "counted across all optimizers); give each parameter to one optimizer group only"
                    )
                seen[param] = index
            by_group.append(trainable)
        orphans = [n for p, n in self._names.items() if p.requires_grad and p not in seen]
        if orphans:
            warnings.warn(
                f"these trainable parameters are in no optimizer group, so ZeRO neither reduces nor updates them: "
                f"{', '.join(orphans)}. Add them to the optimizer or set requires_grad=False.",
                stacklevel=4,
            )
        return by_group

    @property
    def optimizer(self) -> ShardedOptimizer:
        """The optimizer facade to step (an ``torch.optim.Optimizer``); with several optimizers use ``optimizers``."""
        if len(self.optimizers) != 1:
            raise RuntimeError(
                f"this engine trains {len(self.optimizers)} optimizers: use engine.optimizers[k] (in the order given "
                "to zero_core.setup) instead of engine.optimizer"
            )
        return self.optimizers[0]

    def optimizer_indices(self, optimizer: OptimizerRef = None) -> list[int]:
        """Which optimizers ``optimizer`` means: None is all; else an index, a facade or the user's optimizer.
        Front-ends unwrap their own optimizer wrappers (or pass the index) before calling."""
        if optimizer is None:
            return list(range(len(self.optimizers)))
        if isinstance(optimizer, int):
            if not 0 <= optimizer < len(self.optimizers):
                raise IndexError(f"optimizer index {optimizer} is out of range: this engine has "
                                 f"{len(self.optimizers)} optimizers")
            return [optimizer]
        inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer  # a facade: its optimizer
        for k, candidate in enumerate(self.inner_optimizers):
            if inner is candidate:
                return [k]
        raise ValueError(f"{type(optimizer).__name__} is not one of this engine's optimizers: pass one given to "
                         "zero_core.setup, its facade from engine.optimizers, or its index")

    def trainable_params(self, optimizer: OptimizerRef = None) -> list[nn.Parameter]:
        """The model parameters the engine updates: one optimizer's, or all (fixed at setup, whatever
        requires_grad says later)."""
        return [p for part in self._parts(self.optimizer_indices(optimizer)) for p in part.params]

    def _parts(self, indices: list[int]) -> list:
        return [part for k in indices for part in self._parts_of[k]]

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
        if self._scaler is not None:
            self._settle_notes()  # fp16: what arrived so far came from backward passes outside this method
        self._engine_backward = True
        try:
            (loss * self.loss_scale if self._scaler is not None else loss).backward(**kwargs)
        finally:
            self._engine_backward = False
            if self._scaler is not None:
                self._settle_notes(scaled=True)

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

    def generation(self, max_live_parameters: Optional[int] = None) -> GenerationSession:
        """``with engine.generation() as session:`` around a decoding loop: stage 3 keeps gathered parameters
        across its no-grad forwards, up to ``max_live_parameters`` elements (default: the config's
        ``generation_max_live_parameters``, else ``max_live_parameters``), and releases them on leaving. Enter it
        on every rank; ``session.all_finished(done)`` tells when every rank is done (docs/stage3.md)."""
        return GenerationSession(self, max_live_parameters)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """``with engine.ema_weights():`` the model holds the moving average of its weights (``weights_ema_decay``)
        instead of the trained ones, e.g. for validation or ``save_16bit_model``; they come back, exactly, on
        leaving. A collective at entry and exit (stage 3 and stages 1-2 gather the parameters again); call it on
        every rank, between optimizer steps."""
        if self.weights_ema is None:
            raise RuntimeError("engine.ema_weights() needs a moving average of the weights: set "
                               "zero_optimization.weights_ema_decay (e.g. 0.999) in the config given to setup")
        self._exchange_ema()
        try:
            yield
        finally:
            self._exchange_ema()

    def _exchange_ema(self) -> None:
        parts = self.runtime.parts
        with self.offload_resident():
            self.weights_ema.exchange([m for part in parts for m in part.masters])
        self.refresh_params_from_masters()

    def join(self, enable: bool = True, throw_on_early_termination: bool = False):
        """Uneven inputs: ``with engine.join(): for batch in my_batches: ...`` lets ranks with fewer batches
        shadow the others' steps until all are done (``torch.distributed.algorithms.Join`` semantics; join.py)."""
        from zero_core.join import join_context

        return join_context(self, enable, throw_on_early_termination)

    def joinable(self):
        """``with engine.joinable() as j: with Join([j, ...]): ...``: the engine as one ``Joinable`` among others
        in a ``Join`` the caller builds (Accelerate's ``join_uneven_inputs`` does). A context manager."""
        from zero_core.join import attached_joinable

        return attached_joinable(self)

    def _settle_notes(self, scaled: bool = False) -> None:
        """Move the gradients noted by the hooks (grad_notes.py) into each optimizer's pending record; ``scaled``:
        they came from ``engine.backward`` (fp16: the loss was scaled). Called before anything reads the record."""
        arrivals = self._notes.take()
        if not arrivals:
            return
        keys = set(map(id, arrivals))
        if len(self._pending) == 1:
            by_optimizer = {0: keys}
        else:
            by_optimizer = {}
            for key in keys:
                by_optimizer.setdefault(self._optimizer_by_id[key], set()).add(key)
        for k, used in by_optimizer.items():
            pending = self._pending[k]
            pending.used |= used
            pending.saw_grad = True
            pending.unscaled |= not scaled

    def _note_grad(self, param: torch.Tensor) -> None:
        """A gradient's note while armed (``GradNotes.arm``: some optimizer's gradients were reduced already)."""
        key = id(param)
        pending = self._pending[self._optimizer_by_id[key]]
        pending.used.add(key)
        if pending.reduced and self._averages_whole_grads() and pending.clip_coef is None:
            pending.reduced = False  # averaged gradients plus new local ones average again to the right sum
        elif pending.reduced:
            raise RuntimeError(
                f"a backward produced a gradient for '{self._names.get(param, '?')}' after this step's gradients were "
                "already reduced (by clip_grad_norm_, reduce_gradients or a safe_get_full_grad call), so it would be "
                "lost: run every backward of the step first, then clip, then step()"
            )
        pending.saw_grad = True
        pending.unscaled |= not self._engine_backward

    def reduce_gradients(self, optimizer: OptimizerRef = None) -> None:
        """Reduce pending gradients now (stage 1 otherwise waits for clipping or the step). A collective.
        ``optimizer`` limits it to one optimizer's parameters (see :meth:`optimizer_indices`)."""
        if self._reduce_pending(self.optimizer_indices(optimizer)):
            self._notes.arm()  # a later gradient before the step is noted in Python, and may raise there

    def _reduce_pending(self, indices: list[int]) -> bool:
        """Reduce the gradients of optimizers ``indices`` not reduced yet; whether there were any."""
        self._adopt_trainable()
        indices = [k for k in indices if not self._pending[k].reduced]
        if not indices:
            return False
        self.runtime.reduce_gradients(self._parts(indices))
        for k in indices:
            self._pending[k].reduced = True
        return True

    def _grad_shards(self, indices: list[int]) -> list[torch.Tensor]:
        return [s for part in self._parts(indices) for s in part.grad_shards()]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, optimizer: OptimizerRef = None) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (each element counted once); returns that norm.
        ``optimizer`` limits the norm and the clipping to one optimizer's parameters (default: all)."""
        indices = self.optimizer_indices(optimizer)
        self.reduce_gradients(optimizer)
        norm = self._global_norm(float(norm_type), self._grad_shards(indices))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for k in indices:
            self._pending[k].clip_coef = coef
        return norm

    def _global_norm(self, norm_type: float, grad_shards: list[torch.Tensor]) -> torch.Tensor:
        norms = _shard_norms(grad_shards, norm_type, self.device)
        if math.isinf(norm_type):
            local = norms.max()
            self.comm.all_reduce(local, op=dist.ReduceOp.MAX)
            return local / self.loss_scale
        local = norms.pow(norm_type).sum()
        self.comm.all_reduce(local)
        return local.pow(1.0 / norm_type) / self.loss_scale

    def _agree_on_step(self, k: int) -> tuple[bool, list[list[bool]]]:
        """One small all-reduce (MAX) tells every rank whether any rank saw an fp16 overflow, and which of
        optimizer ``k``'s parameters got a gradient on some rank (per part, in ``part.params`` order)."""
        parts = self._parts_of[k]
        count = sum(len(part.params) for part in parts)
        used = self._pending[k].used
        all_used = len(used) == count  # every parameter got a gradient here (used holds only this optimizer's)
        if all_used:  # made where it is used: a host-to-device copy would wait for the device
            flags = torch.ones(count + 1, dtype=torch.uint8, device=self.device)
            flags[:1].zero_()  # a kernel; `flags[0] = 0` copies the scalar in from the host and waits (measured)
        else:
            flags = torch.zeros(count + 1, dtype=torch.uint8)
            if used:
                flags[torch.tensor([self._flag_slot[key] + 1 for key in used], dtype=torch.long)] = 1
            flags = flags.to(self.device)
        if self._scaler is not None:  # one max-norm kernel per dtype, no host sync: inf and nan propagate
            flags[0] = ~torch.isfinite(_shard_norms(self._grad_shards([k]), math.inf, self.device).max())
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, over="world")  # MiCS: a gradient on any replica counts
        if all_used and self._scaler is None:
            # Known without reading the result: the MAX of all ones is all ones, and nothing can overflow. Every
            # rank still joins the all-reduce (another may need it); reading it would stall the host until the
            # device has finished backward, and the step's kernels could no longer be queued behind it.
            return False, [[True] * len(part.params) for part in parts]
        agreed = flags.tolist()  # 0 or 1 per parameter: the masks are read as truth values
        masks, start = [], 1
        for part in parts:
            masks.append(agreed[start : start + len(part.params)])
            start += len(part.params)
        return bool(agreed[0]), masks

    def step(self) -> None:
        """Sharded optimizer step over the fp32 masters, then the parameters are refreshed; grads are zeroed.
        With several optimizers, each steps in turn (``engine.optimizers[k].step()`` steps one)."""
        for optimizer in self.optimizers:
            optimizer.step()  # through the facade, so an LR scheduler built on it sees the step

    def _user_step(self, k: int, closure=None):
        """The user's own optimizer.step() (the plain loop): the facade's step, after checking what can't work."""
        self._settle_notes()
        if self._scaler is not None and self._pending[k].unscaled:
            raise RuntimeError(
                "fp16 loss scaling is on (fp16.enabled), but this step's gradients come from loss.backward(), so "
                "the loss was not scaled: call engine.backward(loss) instead (optimizer.step() and zero_grad() "
                "can stay), or train in bf16/fp32, where loss.backward() works"
            )
        return self.optimizers[k].step(closure)  # looked up now: a scheduler built on the facade wraps its step

    def _step(self, k: int) -> None:
        # Before any of the step's collectives: every rank issued the same ones since the last step
        # (collective_guard.py), so a divergence is an error here, not a hang or a wrong update.
        self.comm.guard.step_barrier()
        self._adopt_trainable()  # a parameter unfrozen since the last step may hold this step's only gradient
        pending = self._pending[k]
        if not pending.saw_grad:
            self._zero([k])  # nothing to apply: every rank ran the same (empty) step
            return
        self._reduce_pending([k])  # not armed: no backward can come before this step ends
        overflow, used = self._agree_on_step(k)
        if overflow:
            self.skipped_steps += 1
            self._record_overflow(True)
            self._zero([k])
            return
        if pending.clip_coef is None and self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping, optimizer=k)
        parts = self._parts_of[k]
        with self._routes[k].real_update():  # through any LR scheduler wrapper on it, so that it counts the step
            if self._offload is not None:  # offload hook: tiled step on the host masters (zero_core/offload)
                self._offload.step(self.inner_optimizers[k], parts, used, 1.0 / self.loss_scale,
                                   self._pending[k].clip_coef)
            else:
                step_in_tiles(self.inner_optimizers[k], parts, used, 1.0 / self.loss_scale,
                              self._pending[k].clip_coef, self.step_tile_numel)
        # each way of stepping sets the masters' .grad only around its own optimizer.step() and clears it there
        if self.weights_ema is not None:
            self.weights_ema.update([m for part in parts for m in part.masters])
        self.comm.forget_secondary()  # hpZ: the in-node copies hold the old values
        self.runtime.after_step(parts)
        self._record_overflow(False)
        self._finish_step(k)

    def _record_overflow(self, overflow: bool) -> None:
        """The fp16 scale changes only once no optimizer holds gradients made with the current scale, so that
        every step unscales by the scale its gradients were made with (as GradScaler.update once per iteration)."""
        if self._scaler is not None:
            self._scaler_overflow = bool(self._scaler_overflow) or overflow

    def _maybe_update_scale(self) -> None:
        self._settle_notes()
        if self._scaler_overflow is not None and not any(p.saw_grad for p in self._pending):
            self._scaler.update(overflow=self._scaler_overflow)
            self._scaler_overflow = None

    def _averages_whole_grads(self) -> bool:
        """Stage 1 with ``reduce_scatter: false`` all-reduces whole gradients, exactly as DDP does."""
        return self.config.stage == 1 and not self.config.reduce_scatter

    @property
    def averages_whole_grads(self) -> bool:
        """Whether reducing leaves every rank ``param.grad`` = the averaged whole gradient, as DDP does (stage 1
        with ``reduce_scatter: false``); otherwise each rank holds only its shard of the reduced gradients."""
        return self._averages_whole_grads()

    @property
    def step_zeroes_grads(self) -> bool:
        """Whether ``step()`` consumes the gradients (DeepSpeed's rule) or leaves them for ``zero_grad()``."""
        return not self._averages_whole_grads()

    def _finish_step(self, k: int) -> None:
        """Gradients are consumed, as DeepSpeed's step does; except when they are averaged whole like DDP's
        (see ``_averages_whole_grads``): then, like a torch optimizer, the step leaves them for ``zero_grad()``."""
        if self.step_zeroes_grads:
            self._zero([k])
            return
        self._settle_notes()
        self._pending[k] = _PendingGrads()
        self._disarm_notes()
        self._maybe_update_scale()

    def _disarm_notes(self) -> None:
        """Back to the cheap hooks once no optimizer's gradients are reduced (pending a step) any more."""
        if self._notes.armed and not any(p.reduced for p in self._pending):
            self._notes.disarm()

    @property
    def step_tile_numel(self) -> int:
        """At most this many gradient elements are copied to fp32 at once in a step (``sub_group_size``, bounded
        by ``reduce_bucket_size``): the fp32 copy of 16-bit gradients is made and stepped tile by tile."""
        return planning.step_tile_numel(self.config)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient: the shards, stage 1's full buffers, and unmanaged parameters' ``.grad``."""
        self._zero(list(range(len(self.optimizers))))

    def _zero(self, indices: list[int]) -> None:
        self.runtime.zero_grads(self._parts(indices))
        if self._offload is not None:
            self._offload.forget_grads()  # host copies of the zeroed gradients are stale
        if len(indices) == len(self.optimizers):
            for param in self._unmanaged:
                param.grad = None
        self._settle_notes()
        for k in indices:
            self._pending[k] = _PendingGrads()
        self._disarm_notes()
        self._maybe_update_scale()

    # -- teardown ------------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """Finish every collective still in flight (stage 3 prefetches, overlapped reductions) and free
        gathered parameters, so that ``destroy_process_group()`` and the process exit find nothing pending.

        Call it on every rank when training ends (the front-ends do, at teardown); ``with zero_core.setup(...)
        as engine:`` calls it on leaving the block. It is idempotent, and the engine stays usable: a later
        forward or step simply communicates again. ``wait=False`` (after an error, when another rank may never
        issue the matching collectives) forgets the pending handles instead of waiting, as does a call after
        the process group is gone.

        With NVMe offload it also removes the swap files' names from ``nvme_path`` and stops the ``aio`` and
        write-back threads. The files stay open, so the engine can still evaluate, save or train (the threads
        start again); their disk space is freed by :meth:`remove_offload_files`, when the engine is collected,
        or at exit (docs/offload.md, "NVMe files")."""
        try:
            teardown.quiesce(self.runtime, wait)
        finally:
            teardown.release_offload(self._offload, self.runtime.param_swap)

    def __enter__(self) -> "ZeroEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait=exc_type is None)

    # -- state access (checkpoints, debugging API) ---------------------------------------------------------
    def fragments(self, optimizer: OptimizerRef = None) -> list[Fragment]:
        """This rank's fp32 master (and gradient) pieces of every trainable parameter (or of one optimizer's);
        see zero_core.fragments."""
        return [f for part in self._parts(self.optimizer_indices(optimizer)) for f in part.fragments()]

    def fragments_of(self, name: str) -> list[Fragment]:
        return [f for f in self.fragments() if f.name == name]

    def restore_skipped_steps(self, count: int) -> None:
        """A loaded checkpoint's count of fp16 steps skipped for overflow (zero_core.checkpoint)."""
        self.skipped_steps = int(count)

    def name_of(self, param: torch.Tensor) -> str:
        return self._names[param]

    def refresh_params_from_masters(self) -> None:
        """Make the model's parameters equal the fp32 masters again (after masters were loaded). A collective."""
        self.comm.forget_secondary()
        self.runtime.after_step(self.runtime.parts)

    def optimizer_state_of(self, master: torch.Tensor) -> dict:
        """The optimizer state of one master shard (empty before its first step), whichever optimizer owns it."""
        for optimizer in self.inner_optimizers:
            if master in optimizer.state:
                return optimizer.state[master]
        return {}

    def replicated_state(self) -> dict[str, torch.Tensor]:
        """Buffers and parameters outside every optimizer group, whole. A collective in stage 3, where frozen
        parameters are partitioned and get gathered (all of them at once) into copies."""
        return self.runtime.replicated_state()

    def offload_resident(self, fragments: Optional[list[Fragment]] = None, state: bool = True, write: bool = True):
        """A context in which NVMe-offloaded masters and optimizer state are in memory (a no-op otherwise):
        wrap direct reads of ``fragments()`` / ``optimizer_state_of`` with it. Given ``fragments``: only their
        masters (and, if ``state``, their optimizer state), written out again afterwards if ``write``."""
        if self._offload is None:
            return contextlib.nullcontext()
        if fragments is None:
            return self._offload.resident()
        masters = list({id(f.master): f.master for f in fragments}.values())
        return self._offload.resident(masters, state=state, write=write)

    def offload_tiles(self, fragments: list[Fragment], write: bool = False) -> Iterator[list[Fragment]]:
        """``fragments`` in groups whose masters and optimizer state are in memory while the caller holds the
        group: with NVMe offload, tiles of about ``sub_group_size`` elements read one ahead, then dropped, or with
        ``write`` written back into the model and out to the file (OptimizerOffload.stream); else one group.
        Checkpoints save and load through it, so that NVMe state passes through memory a few tiles at a time."""
        if self._offload is None:
            yield list(fragments)
            return
        of_master: dict[int, list[Fragment]] = {}
        masters = []
        for fragment in fragments:
            if id(fragment.master) not in of_master:
                of_master[id(fragment.master)] = []
                masters.append(fragment.master)
            of_master[id(fragment.master)].append(fragment)
        for tile in self._offload.stream(masters, write):
            yield [f for master in tile for f in of_master[id(master)]]

    def shape_in_memory(self, master: torch.Tensor, key=None) -> torch.Size:
        """The shape of ``master`` (``key`` None) or of its optimizer state ``key`` as in memory, also while it is
        swapped out to NVMe (then the tensor itself is empty)."""
        shape = self._offload.shape_in_memory(master, key) if self._offload is not None else None
        if shape is not None:
            return shape
        return (master if key is None else self.optimizer_state_of(master)[key]).shape

    def remove_offload_files(self) -> None:
        """Close and delete this rank's NVMe swap files (optimizer and parameters) now, freeing their disk space;
        that also happens when the engine is collected and at exit (``close()`` already took their names out of
        ``nvme_path``). The engine cannot train or save afterwards."""
        if self._offload is not None:
            self._offload.close()
        if self.runtime.param_swap is not None:
            self.runtime.param_swap.close()

    def full_state_dict(self, rank0_only: bool = True, masters: bool = True) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` of the trained model as DDP would give it (fp32 masters for trainable
        parameters), as CPU tensors, on rank 0 (every rank unless ``rank0_only``). ``masters=False``: the
        model's own values instead (the training dtype). A collective; see zero_core.checkpoint.full_state."""
        from zero_core.checkpoint.full_state import full_state_dict, live_state_dict

        if not masters:
            return live_state_dict(self, rank0_only=rank0_only)
        return full_state_dict(self, rank0_only=rank0_only)  # NVMe-offloaded masters: read one parameter at a time

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, one at a time (stage 3 gathers each transiently). Call on every rank."""
        yield from self.runtime.iter_full_params()

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write a new full value into the model's own copy of ``param`` (value given on every rank)."""
        self.runtime.refresh_param(param, value)

    def describe(self, param: torch.Tensor) -> str:
        return self._names.get(param, "<unknown>")

    def handles_released(self, func) -> bool:
        """partitioned_param.py's owner protocol: ``torch.equal`` on a partitioned parameter is answered when
        no values are needed (Lightning's BaseFinetuning.filter_on_optimizer compares parameters with it); any
        operation inside the model's forward gathers the parameters it reads (``gather_on_read``)."""
        return func is torch.equal or self.runtime.gathers_on_read()

    def run_on_released(self, func, args, kwargs):
        if func is not torch.equal:
            self.runtime.gather_on_read(released_params(args, kwargs))
            return dispatch_gathered(func, args, kwargs)
        first, second = (list(args) + list(kwargs.values()))[:2]
        if first is second:
            return True
        with torch._C.DisableTorchFunctionSubclass():
            if first.shape != second.shape or first.dtype != second.dtype:
                return False
        raise RuntimeError(
            f"torch.equal needs the values of '{self.describe(first)}' or '{self.describe(second)}', which ZeRO stage "
            "3 keeps partitioned: compare them inside `with zero_core.GatheredParameters([a, b]):`, or compare "
            "parameters by identity (`a is b`)"
        )

    def gather_params(self, params) -> list:
        """GatheredParameters' entry: gather what is partitioned (stage 3). A collective."""
        return self.runtime.gather_params(params)

    def commit_params(self, params, opened: list, modified: bool) -> None:
        """GatheredParameters' exit: keep modified values (masters included), release what was gathered."""
        with self.offload_resident():
            self.runtime.commit_params(params, opened, modified)

    def empty_partition_cache(self) -> None:
        """Release every gathered stage 3 parameter that is not in use (no-op for stages 1 and 2)."""
        self.runtime.release_all()

    # -- checkpoints (zero_core.checkpoint; every rank calls these) -----------------------------------------
    def save_checkpoint(self, path, client_state: Optional[dict] = None):
        """Write a sharded checkpoint directory atomically (docs/checkpoints.md)."""
        from zero_core.checkpoint import save_checkpoint

        return save_checkpoint(self, path, client_state)  # NVMe-offloaded state streams a few tiles at a time

    def load_checkpoint(self, path, strict: bool = True, load_optimizer_states: bool = True) -> Optional[dict]:
        """Load a checkpoint saved at any world size and stage (or a plain state dict); returns client_state."""
        from zero_core.checkpoint import load_checkpoint

        return load_checkpoint(self, path, strict=strict, load_optimizer_states=load_optimizer_states)

    def save_16bit_model(self, out_dir, weights_ema: bool = False, **kwargs) -> bool:
        """16-bit safetensors of the whole model, streamed one parameter (unit) at a time; ``weights_ema``: of
        the moving average of the weights instead (``ema_weights()``)."""
        from zero_core.checkpoint import save_16bit_model

        with self.ema_weights() if weights_ema else contextlib.nullcontext():
            return save_16bit_model(self, out_dir, **kwargs)

    # -- introspection -------------------------------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements, bytes, and bytes sent to this node's ranks (``in_node_bytes``) and to other nodes'
        (``cross_node_bytes``), per collective since the last :meth:`reset_comm_stats` (zero_core/comm/communicator.py)."""
        empty = {"calls": 0, "elements": 0, "bytes": 0, "in_node_bytes": 0, "cross_node_bytes": 0}
        stats = {name: dict(empty) for name in ("reduce_scatter", "all_gather", "all_reduce")}
        stats.update(self.comm.stats())
        return stats

    def link_bytes(self) -> dict[str, int]:
        """Bytes this rank sent inside its node and across nodes since the last :meth:`reset_comm_stats`."""
        return self.comm.link_bytes()

    def reset_comm_stats(self) -> None:
        self.comm.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held on this rank now: params, grads, fp32_master, optimizer_state, buffers (and weights_ema when
        weights_ema_decay is set)."""
        stats = model_state_bytes(self.module, self.inner_optimizers, self.runtime)
        stats["params"] += self.comm.paths.secondary_nbytes()  # hpZ's in-node copy of the 16-bit parameters
        if self.weights_ema is not None:  # the sharded moving average (weights_ema_decay): 4 bytes per master element
            stats["weights_ema"] = sum(t.numel() * t.element_size() for t in self.weights_ema.tensors())
        return stats

    def expect_gradients_from_other_ranks(self) -> None:
        """A joined-rank step (``join()``): this rank ran no backward, but the other ranks' gradients arrive in its
        shards, so every optimizer steps as after a backward."""
        for pending in self._pending:
            pending.saw_grad = True


def _weights_ema(config: ZeroConfig, parts: list):
    """The sharded moving average of the master weights (optim/weights_ema.py), or None when it is off."""
    if config.weights_ema_decay is None:
        return None  # (with NVMe offload it is refused by the config: config.py)
    ema = WeightsEMA(config.weights_ema_decay)
    ema.track(m for part in parts for m in part.masters)
    return ema


def _as_optimizer_list(optimizer, call: str = "zero_core.setup") -> list[torch.optim.Optimizer]:
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError(f"{call} needs at least one optimizer")
    for index, candidate in enumerate(optimizers):
        if not isinstance(candidate, torch.optim.Optimizer):
            where = f"optimizer[{index}]" if len(optimizers) > 1 else "optimizer"
            raise TypeError(f"{call}: {where} must be a torch.optim.Optimizer, got {described(candidate)}. "
                            f"{_optimizer_fix(candidate)}")
    return optimizers


def _optimizer_fix(candidate) -> str:
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
        return f"Build it first: torch.optim.{candidate.__name__}(model.parameters(), lr=...)"
    if isinstance(candidate, (dict, str, os.PathLike, ZeroConfig)):
        return "The configuration is the third argument: zero_core.setup(model, optimizer, config)"
    return ("Pass the optimizer itself (a wrapper's inner optimizer, e.g. .optimizer), built over "
            "model.parameters(): zero_core.setup(model, optimizer, config)")


def setup(
    model: nn.Module,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
    config: ConfigLike = None,
    process_group: Optional[dist.ProcessGroup] = None,
) -> ZeroEngine:
    """Put ``model`` and ``optimizer`` under ZeRO; ``config`` is a ZeroConfig, a dict, a JSON/YAML path or None.

    ``optimizer`` may be a list: each optimizer then steps, clips and zeroes only its own parameters
    (``engine.optimizers[k]``), e.g. a generator's and a discriminator's."""
    check_module(model, "zero_core.setup", "model",
                 "Pass the model first, then its optimizer: zero_core.setup(model, optimizer, config)")
    optimizers = _as_optimizer_list(optimizer)
    check_process_group(process_group, "zero_core.setup", "process_group")
    config = ZeroConfig.coerce(config, "zero_core.setup: config")
    if config.auto_fields:
        config = config.resolve_auto()  # front-ends resolve "auto" from their run first; the rest is reported
    if config.stage == 0:
        raise ValueError(
            "zero_optimization.stage=0 disables ZeRO: use torch's DistributedDataParallel, or pick stage 1, 2 or 3"
        )
    config.warn_unimplemented()
    if checkpointing.configure(deepspeed_config=config).active:  # the activation_checkpointing block
        checkpointing.route_hf_checkpointing(model)
    topology = Topology.from_process_group(process_group, mics_shard_size=config.mics_shard_size,
                                           hpz_partition_size=config.zero_hpz_partition_size,
                                           hierarchical_gather=config.mics_hierarchical_params_gather)
    return ZeroEngine(model, optimizers, config, topology)


def _shard_norms(shards: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Each gradient shard's norm, accumulated in fp32 on the device: one foreach kernel per (device, dtype)
    group and no fp32 copy of the shards. Empty shards count as zero."""
    groups: dict = {}
    for shard in shards:
        if shard.numel():
            groups.setdefault((shard.device, shard.dtype), []).append(shard)
    norms = [torch.zeros((), device=device)]
    for tensors in groups.values():
        norms += [n.to(device) for n in torch._foreach_norm(tensors, norm_type, dtype=torch.float32)]
    return torch.stack(norms)
