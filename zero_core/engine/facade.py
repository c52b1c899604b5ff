"""``ZeroEngine``: the one object both front-ends drive, a facade over objects with one concern each.

The stage is a policy, not a second engine: a *runtime* decides where parameters and gradients live (stages 1-2:
whole parameters, sharded gradients in stage 2; stage 3: partitioned parameters gathered by hooks) and answers
what differs by stage (contracts.Runtime). The engine wires the rest: the optimizer binding (which units and
groups each optimizer steps), the pending gradients (which parameters got one since the last step), the step
(loss scaling, clipping by the global norm, the sharded step over the fp32 masters), the masters' backend (on
the device, or offloaded), statistics, and checkpoints (zero_core.checkpoint). docs/core-api.md is the user's
guide.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn

from zero_core import registry, teardown
from zero_core.checkpoint import shard_identity
from zero_core.comm.communicator import CommOptions, Communicator
from zero_core.comm.topology import Topology
from zero_core.config import ZeroConfig
from zero_core.contracts import PieceSlices
from zero_core.engine import statistics
from zero_core.engine.binding import OptimizerBinding, OptimizerRef, as_optimizer_list
from zero_core.engine.masters import masters_for
from zero_core.engine.pending import PendingGradients
from zero_core.engine.step import OptimizerStep
from zero_core.fragments import Fragment
from zero_core.offload import adopt as offload_new_units, attach as attach_offload
from zero_core.optim.loss_scaler import LossScaler
from zero_core.optim.mixed_precision import cast_floating_inputs
from zero_core.optim.sharded_optimizer import ShardedOptimizer
from zero_core.optim.weights_ema import WeightsEMA
from zero_core.plain_loop import OptimizerRoute
from zero_core.replicated.runtime import ReplicatedParamsRuntime
from zero_core.stage3.generation import GenerationSession
from zero_core.stage3.partitioned_param import dispatch_gathered, released_params, unguarded
from zero_core.stage3.runtime import PartitionedParamsRuntime

ConfigLike = Union[ZeroConfig, dict, str, "os.PathLike[str]", None]

# Which runtime each stage gets: the stages differ only in where parameters and gradients live.
RUNTIME_OF_STAGE = {0: ReplicatedParamsRuntime, 1: ReplicatedParamsRuntime, 2: ReplicatedParamsRuntime,
                    3: PartitionedParamsRuntime}


class ZeroEngine:
    """A model and its optimizer under ZeRO. Build it with :func:`zero_core.setup`."""

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], config: ZeroConfig,
                 topology: Topology):
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = Communicator(topology, CommOptions.from_config(config))
        self._no_sync_depth = 0
        self._scaler = LossScaler.from_fp16_config(config.fp16) if config.fp16.enabled else None
        runtime_class = RUNTIME_OF_STAGE[config.stage]
        runtime_class.prepare_module(module, config)  # the dtype cast (stage 3: buffers only), leaf modules
        if config.fp16.enabled and config.fp16.auto_cast:
            module.register_forward_pre_hook(cast_floating_inputs(config.param_dtype), with_kwargs=True)
        self._names = {param: name for name, param in module.named_parameters()}
        self._binding = OptimizerBinding(module, self._names)
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self._binding.record_groups(groups)
        trainable = self._binding.trainable_by_group(groups)
        self.runtime = runtime_class(module, trainable, self._names, config, self.comm)
        # offload (zero_core/offload): host/NVMe masters replace the runtime's before optimizers bind
        self._masters = masters_for(attach_offload(self.runtime, config, topology.rank), config)
        self.runtime.serve_generation(self)  # stage 3: Hugging Face generate() in sessions
        registry.register(self.runtime.managed_params(), self)
        # The model holds its engines, the registry only weakly: a partitioned model needs its engine for as long as
        # it lives (lookups from its parameters must give every rank the same answer, whenever the cycle collector
        # runs), and a dropped model and engine go together.
        module.__dict__.setdefault("_zero_core_engines", []).append(self)
        # Which parameters got a gradient: each one's hook appends it to a list, with no Python per gradient
        # (zero_core.grad_notes). Stage 2's reducer hooks every trainable parameter already and records it from
        # there; otherwise the engine hooks them itself. Neither the hooks nor the runtime hold the engine.
        self._grads = PendingGradients(self._binding, self.runtime.averages_whole_grads, self._names)
        weakref.finalize(self, self._grads.notes.arrivals.clear)
        self._runtime_notes_grads = self.runtime.take_grad_notes(self._grads.notes)
        if not self._runtime_notes_grads:
            self._grads.notes.hook(p for p in self.runtime.managed_params() if p.requires_grad)
        self._stepper = OptimizerStep(config, self.comm, self.runtime, self._binding, self._grads, self._masters,
                                      self._scaler, self._add_unfrozen)
        self._bind_optimizers(optimizers)
        self._stepper.weights_ema = _weights_ema(config, self.runtime.parts)  # None unless weights_ema_decay is set
        self.comm.reset()  # setup's broadcasts and gathers are not training traffic
        teardown.destroy_group_at_exit()  # a group left up at exit is closed while Python still runs
        self._exit_finalizer = teardown.close_at_exit(self, self.runtime)  # for scripts that never call close()

    # -- what the parts hold, for the checkpoint contract (contracts.CheckpointedEngine) and debugging ---------
    @property
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The user's optimizers, narrowed to this rank's master shards."""
        return self._binding.inner_optimizers

    @property
    def group_optimizer(self) -> list[int]:
        """Per optimizer group (counted across optimizers): its optimizer's index."""
        return self._binding.group_optimizer

    @property
    def group_params(self) -> list[list[nn.Parameter]]:
        """Per optimizer group: its own parameters (frozen ones included), before narrowing to master shards."""
        return self._binding.group_params

    @property
    def group_param_names(self) -> list[list[str]]:
        return self._binding.group_param_names

    @property
    def weights_ema(self) -> Optional[WeightsEMA]:
        """The sharded moving average of the masters (``weights_ema_decay``), or None."""
        return self._stepper.weights_ema

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for overflow."""
        return self._stepper.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self._stepper.skipped_steps = count

    @property
    def _offload(self):
        """The ``OptimizerOffload`` (zero_core/offload) holding the masters, or None (tests and tools read it)."""
        return self._masters.offload

    @property
    def _notes(self):
        return self._grads.notes

    @property
    def _pending(self) -> list:
        """Each optimizer's pending gradients (``PendingGrads``)."""
        return self._grads.of_optimizer

    # -- setup ---------------------------------------------------------------------------------------------
    def _bind_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Narrow each optimizer to this rank's master shards and give it a facade that steps through here."""
        self._binding.bind(optimizers, self.runtime.parts)
        self._masters.bind(self._binding.inner_optimizers)  # offload: the state it swaps with the masters
        stepper = self._stepper
        self.optimizers = [ShardedOptimizer(opt, functools.partial(stepper.step, k),
                                            functools.partial(stepper.zero, [k]),
                                            functools.partial(self.add_param_group, k))
                           for k, opt in enumerate(optimizers)]
        for k, facade in enumerate(self.optimizers):
            facade.describe_shard = functools.partial(shard_identity.describe, self, k)
        for k, optimizer in enumerate(optimizers):
            # The user's own optimizer object adds groups through the engine too (its groups hold master shards).
            optimizer.add_param_group = functools.partial(self.add_param_group, k)
        # The plain loop: the user's own optimizer.step()/zero_grad() do what the facade's do (plain_loop.py).
        stepper.routes = [OptimizerRoute(opt, functools.partial(self._user_step, k),
                                         functools.partial(stepper.zero, [k]))
                          for k, opt in enumerate(optimizers)]
        # Like a torch optimizer skipping parameters whose .grad is None, a step with no backward since the
        # last zero_grad changes nothing (no weight decay, no moment update).
        self._grads.reset(len(optimizers))

    # -- the trainable set changes (docs/core-api.md, "When the trainable parameters change") --------------
    def add_param_group(self, optimizer: OptimizerRef, param_group: dict) -> None:
        """``optimizer.add_param_group`` after setup: model parameters (frozen at setup, e.g. a backbone being
        unfrozen) join optimizer ``optimizer`` as a new group, with this group's hyper-parameters. Call it on
        every rank, between steps."""
        k = self.optimizer_indices(optimizer)[0]
        self._binding.insert_group(k, param_group, self.runtime.parts)
        self._add_unfrozen()

    def _add_unfrozen(self) -> None:
        """Parameters of an optimizer group that require a gradient now but did not when their group was set up
        get their master shards here (stage 3: their units become trainable). Every rank runs this at the same
        points (before reducing gradients, and in add_param_group), as requires_grad is the same everywhere."""
        self._grads.collect()
        with unguarded():  # metadata of every parameter, every step: not the user's code the guard watches
            fresh = self._binding.newly_trainable()
        if not fresh:
            return
        had_grad = [p for params in fresh.values() for p in params if p.grad is not None]
        new_units = self.runtime.add_trainable(fresh)
        offload_new_units(self.runtime, new_units, self.config, self._offload)  # they are offloaded too
        new_params = [p for params in fresh.values() for p in params]
        registry.register(new_params, self)
        if not self._runtime_notes_grads:  # else the runtime's new hooks record them
            self._grads.notes.hook(new_params)
        self._binding.index(self.runtime.parts)
        self._binding.add_masters(new_units)
        for param in had_grad:  # a backward ran since they were unfrozen: that gradient counts
            pending = self._grads.of_optimizer[self._binding.optimizer_of[param]]
            pending.used.add(id(param))
            pending.saw_grad = True

    def replace_optimizers(self, optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]) -> None:
        """Train on with fresh optimizers (a second ``fit``): the partitioning and the fp32 master weights stay.

        The new optimizers must hold the same trainable parameters in the same groups as the ones given to
        :func:`setup`; their state starts empty. Gradients are cleared.
        """
        optimizers = as_optimizer_list(optimizers, "ZeroEngine.replace_optimizers")
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        self._binding.check_same_groups(groups)
        self.zero_grad()
        for route in self._stepper.routes:
            route.unroute()
        self._binding.record_groups(groups)
        self._bind_optimizers(optimizers)

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
        return self._binding.optimizer_indices(optimizer, len(self.optimizers))

    def trainable_params(self, optimizer: OptimizerRef = None) -> list[nn.Parameter]:
        """The model parameters the engine updates: one optimizer's, or all (fixed at setup, whatever
        requires_grad says later)."""
        return [p for unit in self._binding.units(self.optimizer_indices(optimizer)) for p in unit.params]

    @property
    def device(self) -> torch.device:
        return self._stepper.device

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
        grads = self._grads
        if self._scaler is not None:
            grads.collect()  # fp16: what arrived so far came from backward passes outside this method
        grads.inside_backward = True
        try:
            (loss * self.loss_scale if self._scaler is not None else loss).backward(**kwargs)
        finally:
            grads.inside_backward = False
            if self._scaler is not None:
                grads.collect(scaled=True)

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
        units = self.runtime.parts
        with self.offload_resident():
            self.weights_ema.exchange([m for unit in units for m in unit.masters])
        self.refresh_params_from_masters()

    def join(self, enable: bool = True, throw_on_early_termination: bool = False):
        """Uneven inputs: ``with engine.join(): for batch in my_batches: ...`` lets ranks with fewer batches
        shadow the others' steps until all are done (``torch.distributed.algorithms.Join`` semantics;
        zero_core.join)."""
        from zero_core.join import join_context

        return join_context(self, enable, throw_on_early_termination)

    def joinable(self):
        """``with engine.joinable() as j: with Join([j, ...]): ...``: the engine as one ``Joinable`` among others
        in a ``Join`` the caller builds (Accelerate's ``join_uneven_inputs`` does). A context manager."""
        from zero_core.join import attached_joinable

        return attached_joinable(self)

    def reduce_gradients(self, optimizer: OptimizerRef = None) -> None:
        """Reduce pending gradients now (stage 1 otherwise waits for clipping or the step). A collective.
        ``optimizer`` limits it to one optimizer's parameters (see :meth:`optimizer_indices`)."""
        self._stepper.reduce_now(self.optimizer_indices(optimizer))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, optimizer: OptimizerRef = None) -> torch.Tensor:
        """Clip by the global gradient norm over every shard (each element counted once); returns that norm.
        ``optimizer`` limits the norm and the clipping to one optimizer's parameters (default: all)."""
        return self._stepper.clip(max_norm, norm_type, self.optimizer_indices(optimizer))

    def _agree_on_step(self, k: int) -> tuple[bool, list[list[bool]]]:
        """The step's one flag all-reduce (overflow, which parameters got a gradient on some rank), alone."""
        return self._stepper.agree(k)

    def step(self) -> None:
        """Sharded optimizer step over the fp32 masters, then the parameters are refreshed; grads are zeroed.
        With several optimizers, each steps in turn (``engine.optimizers[k].step()`` steps one)."""
        for optimizer in self.optimizers:
            optimizer.step()  # through the facade, so an LR scheduler built on it sees the step

    def _user_step(self, k: int, closure=None):
        """The user's own optimizer.step() (the plain loop): the facade's step, after checking what can't work."""
        self._grads.collect()
        if self._scaler is not None and self._grads.of_optimizer[k].unscaled:
            raise RuntimeError(
                "fp16 loss scaling is on (fp16.enabled), but this step's gradients come from loss.backward(), so "
                "the loss was not scaled: call engine.backward(loss) instead (optimizer.step() and zero_grad() "
                "can stay), or train in bf16/fp32, where loss.backward() works"
            )
        return self.optimizers[k].step(closure)  # looked up now: a scheduler built on the facade wraps its step

    @property
    def averages_whole_grads(self) -> bool:
        """Whether reducing leaves every rank ``param.grad`` = the averaged whole gradient, as DDP does (stage 1
        with ``reduce_scatter: false``); otherwise each rank holds only its shard of the reduced gradients."""
        return self.runtime.averages_whole_grads()

    @property
    def step_zeroes_grads(self) -> bool:
        """Whether ``step()`` consumes the gradients (DeepSpeed's rule) or leaves them for ``zero_grad()``."""
        return not self.runtime.averages_whole_grads()

    @property
    def step_tile_numel(self) -> int:
        """At most this many gradient elements are copied to fp32 at once in a step (``sub_group_size``, bounded
        by ``reduce_bucket_size``): the fp32 copy of 16-bit gradients is made and stepped tile by tile."""
        from zero_core import planning

        return planning.step_tile_numel(self.config)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient: the shards, stage 1's full buffers, and unmanaged parameters' ``.grad``."""
        self._stepper.zero(list(range(len(self.optimizers))))

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
        or at exit (docs/offload.md, "NVMe files").

        With ``offload_optimizer.delayed_update_after`` it waits for the last step's update, running on the host,
        and (``wait``) writes it into the model, so that the model holds the trained weights."""
        try:
            if wait and self._masters.lands_delayed_update():
                self.refresh_params_from_masters()  # a collective: every rank closes
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
        return [f for unit in self._binding.units(self.optimizer_indices(optimizer)) for f in unit.fragments()]

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

    def replicated_layout(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Name -> (whole shape, dtype) of the replicated state, in :meth:`iter_replicated`'s order; no collective."""
        return self.runtime.replicated_layout()

    def iter_replicated(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The replicated state one item at a time, whole: in stage 3 frozen parameters are gathered one unit at
        a time (a collective: call on every rank; copy what you keep before the next item)."""
        yield from self.runtime.iter_replicated()

    def offload_resident(self, fragments: Optional[list[Fragment]] = None, state: bool = True, write: bool = True):
        """A context in which NVMe-offloaded masters and optimizer state are in memory (a no-op otherwise):
        wrap direct reads of ``fragments()`` / ``optimizer_state_of`` with it. Given ``fragments``: only their
        masters (and, if ``state``, their optimizer state), written out again afterwards if ``write``."""
        return self._masters.resident(fragments, state=state, write=write)

    def offload_tiles(self, fragments: list[Fragment], write: bool = False) -> Iterator[list[Fragment]]:
        """``fragments`` in groups whose masters and optimizer state are in memory while the caller holds the
        group: with NVMe offload, tiles of at most ``sub_group_size`` (and 1M) elements read one ahead, then
        dropped, or with ``write`` written back into the model and out to the file (OptimizerOffload.stream); else
        one group.
        Checkpoints save and load through it, so that NVMe state passes through memory a few tiles at a time."""
        return self._masters.tiles(fragments, write)

    def offload_in_file(self, fragment: Fragment) -> Optional[PieceSlices]:
        """While :meth:`offload_tiles` holds ``fragment``: with NVMe offload, its master piece when it is bigger
        than a tile, left in the swap file for the caller to read and write a slice at a time
        (offload/piece_in_file.py); None where the tile brought it into memory."""
        return self._masters.in_file(fragment)

    def shape_in_memory(self, master: torch.Tensor, key=None) -> torch.Size:
        """The shape of ``master`` (``key`` None) or of its optimizer state ``key`` as in memory, also while it is
        swapped out to NVMe (then the tensor itself is empty)."""
        shape = self._masters.shape_in_memory(master, key)
        if shape is not None:
            return shape
        return (master if key is None else self.optimizer_state_of(master)[key]).shape

    def remove_offload_files(self) -> None:
        """Close and delete this rank's NVMe swap files (optimizer and parameters) now, freeing their disk space;
        that also happens when the engine is collected and at exit (``close()`` already took their names out of
        ``nvme_path``). The engine cannot train or save afterwards."""
        self._masters.close()
        if self.runtime.param_swap is not None:
            self.runtime.param_swap.close()

    def full_state_dict(self, rank0_only: bool = True, masters: bool = True,
                        exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` of the trained model as DDP would give it (fp32 masters for trainable
        parameters), as CPU tensors, on rank 0 (every rank unless ``rank0_only``). ``masters=False``: the
        model's own values instead (the training dtype). ``exclude_frozen_parameters``: without the parameters
        the engine does not train, which are then not gathered. A collective; see zero_core.checkpoint.full_state."""
        from zero_core.checkpoint.full_state import full_state_dict, live_state_dict

        read = full_state_dict if masters else live_state_dict  # NVMe-offloaded masters: one parameter at a time
        return read(self, rank0_only=rank0_only, exclude_frozen_parameters=exclude_frozen_parameters)

    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, whole, one at a time (stage 3 gathers each transiently). Call on every rank."""
        yield from self.runtime.iter_full_params()

    def refresh_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Write a new full value into the model's own copy of ``param`` (value given on every rank)."""
        self.runtime.refresh_param(param, value)

    def rewritten_fragments(self, params) -> list[Fragment]:
        """The fragments whose masters a change of ``params`` rewrites (Runtime.rewritten_fragments): what to hold
        resident (``offload_resident``) around :meth:`refresh_param`."""
        return self.runtime.rewritten_fragments(params)

    def describe(self, param: torch.Tensor) -> str:
        return self._names.get(param, "<unknown>")

    def handles_released(self, func) -> bool:
        """The parameter owner's protocol (contracts.ParamOwner): ``torch.equal`` on a partitioned parameter is
        answered when no values are needed (Lightning's BaseFinetuning.filter_on_optimizer compares parameters
        with it); any operation inside the model's forward gathers the parameters it reads (``gather_on_read``)."""
        return func is torch.equal or self.runtime.gathers_on_read()

    def gather_for_read(self, params) -> bool:
        """A read in compiled code that no hook covers gathers as an eager read does: inside the model's forward or
        a backward only."""
        if not self.runtime.gathers_on_read():
            return False
        self.runtime.gather_on_read(params)
        return True

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

    def gather_params(self, params, editing: bool = False) -> list:
        """GatheredParameters' entry: gather what is partitioned (stage 3). A collective."""
        return self.runtime.gather_params(params, editing)

    def commit_params(self, params, opened: list, modified: bool) -> None:
        """GatheredParameters' exit: keep modified values (masters included), release what was gathered."""
        rewritten = self.runtime.rewritten_fragments(params) if modified else []
        with self.offload_resident(rewritten, state=False):  # NVMe: only the masters it rewrites, read in
            self.runtime.commit_params(params, opened, modified)

    def empty_partition_cache(self) -> None:
        """Release every gathered stage 3 parameter that is not in use (no-op for stages 1 and 2)."""
        self.runtime.release_all()

    # -- checkpoints (zero_core.checkpoint does the work; every rank calls these) -----------------------------
    def save_checkpoint(self, path, client_state: Optional[dict] = None, exclude_frozen_parameters: bool = False,
                        save_optimizer_states: bool = True):
        """Write a sharded checkpoint directory atomically (docs/checkpoints.md); ``exclude_frozen_parameters``
        leaves out the parameters the engine does not train (DeepSpeed's keyword), ``save_optimizer_states=False``
        the optimizer's state (Lightning's ``weights_only``)."""
        from zero_core.checkpoint import save_checkpoint

        # NVMe-offloaded state streams a few tiles at a time
        return save_checkpoint(self, path, client_state, exclude_frozen_parameters=exclude_frozen_parameters,
                               save_optimizer_states=save_optimizer_states)

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
        (``cross_node_bytes``), per collective since the last :meth:`reset_comm_stats` (the communicator's counters)."""
        return statistics.comm_stats(self.comm)

    def link_bytes(self) -> dict[str, int]:
        """Bytes this rank sent inside its node and across nodes since the last :meth:`reset_comm_stats`."""
        return self.comm.link_bytes()

    def reset_comm_stats(self) -> None:
        self.comm.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held on this rank now: params, grads, fp32_master, optimizer_state, buffers (and weights_ema when
        weights_ema_decay is set)."""
        return statistics.memory_stats(self.module, self.inner_optimizers, self.runtime, self.comm, self.weights_ema)

    def expect_gradients_from_other_ranks(self) -> None:
        """A joined-rank step (``join()``): this rank ran no backward, but the other ranks' gradients arrive in its
        shards, so every optimizer steps as after a backward."""
        for pending in self._pending:
            pending.saw_grad = True


def _weights_ema(config: ZeroConfig, units: list):
    """The sharded moving average of the master weights (optim/weights_ema.py), or None when it is off."""
    if config.weights_ema_decay is None:
        return None  # (with NVMe offload the config refuses it)
    ema = WeightsEMA(config.weights_ema_decay)
    ema.track(m for unit in units for m in unit.masters)
    return ema
