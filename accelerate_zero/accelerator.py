"""``ZeroAccelerator``: an ``accelerate.Accelerator`` whose models train under the ZeRO engine.

Accelerate has no extension point for a new kind of data parallelism (``DistributedType`` is closed and
custom ``KwargsHandler`` subclasses are rejected), so this subclass overrides the few methods whose stock
behaviour assumes DDP: ``prepare`` builds a ``zero_core`` engine per model instead of wrapping it in DDP;
``backward``/``no_sync``/``clip_grad_norm_`` go through the engine; checkpoints and weights go through
``zero_core.checkpoint``. Everything else (data loaders, schedulers, RNG, logging, gathering) is Accelerate's.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from types import MethodType
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import (
    InitProcessGroupKwargs,
    DynamoBackend,
    compile_regions,
    convert_outputs_to_fp32,
    convert_to_fp32,
    extract_model_from_parallel,
    get_mixed_precision_context_manager,
    is_compiled_module,
)
from accelerate.utils.operations import ConvertOutputsToFp32
from torch import nn
from torch.distributed.algorithms.join import Join

import zero_core
from zero_core import ZeroConfigError, cast_floating_inputs

from . import elastic, hf_trainer, save_pretrained, state_io, weights
from .managed import ManagedModel
from .optimizer import ZeroAcceleratedOptimizer
from .plugin import ZeroPlugin
from .resolve import accumulation_steps, precision_flags, run_config

_OTHER_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin")


class ZeroAccelerator(Accelerator):
    """An ``Accelerator`` that puts each prepared model and its optimizer under ZeRO.

    Takes every ``Accelerator`` argument plus ``zero_plugin`` (a :class:`ZeroPlugin`); without one the ZeRO
    settings come from the environment (``ZeroPlugin.from_env``), so ``accelerate-zero launch`` and plain
    ``accelerate launch`` scripts need no other change. Mixed precision is Accelerate's setting, carried out
    by the engine (16-bit parameters, fp32 master weights, fp16 loss scaling agreed by every rank), or with
    ``ZeroPlugin(autocast=True)`` by Accelerate's own autocast over an fp32 engine. docs/accelerate.md has
    what each overridden method does.
    """

    def __init__(self, *args, zero_plugin: Optional[ZeroPlugin] = None, **kwargs):
        for name in _OTHER_PLUGINS:
            if kwargs.get(name) is not None:
                raise ValueError(f"ZeroAccelerator runs ZeRO itself: drop {name}= (use zero_plugin=ZeroPlugin(...))")
        if _cpu_only_multiprocess() and len(args) < 5:
            kwargs.setdefault("cpu", True)  # torchrun workers without GPUs: gloo on CPU, not N lone processes
        self.zero_plugin = zero_plugin if zero_plugin is not None else ZeroPlugin.from_env()
        hf_trainer.install_if_loaded()  # a Hugging Face Trainer creating us then checkpoints through the engine
        init_for_restart_attempt(cpu=bool(kwargs.get("cpu")) or not torch.cuda.is_available(),
                                  handlers=kwargs.get("kwargs_handlers") or ())
        self._managed: list[ManagedModel] = []
        super().__init__(*args, **kwargs)
        self._engine_precision = self._choose_precision()
        steps = accumulation_steps(self.zero_plugin.config, self.gradient_accumulation_steps)
        if steps != self.gradient_accumulation_steps:
            self.gradient_accumulation_steps = steps

    def _choose_precision(self) -> str:
        """The mixed precision the engine itself runs ("no", "bf16", "fp16"); checks the settings agree."""
        cfg, wanted = self.zero_plugin.config, self.state.mixed_precision
        if not self.zero_plugin.autocast:
            precision_flags(cfg, wanted)  # a contradiction fails here, not at prepare
            # The engine casts the model and scales fp16 losses: Accelerate's autocast and GradScaler stay off.
            self.native_amp, self.scaler = False, None
            return wanted
        if self.scaler is not None:
            raise NotImplementedError(
                "autocast with fp16 needs Accelerate's GradScaler, which cannot see ZeRO's sharded gradients: use "
                "mixed_precision bf16 with autocast, or turn autocast off to train in the engine's fp16"
            )
        if any(precision_flags(cfg, "no").values()):
            raise ZeroConfigError(
                "autocast (torch_autocast) keeps fp32 parameters, but the ZeRO config enables fp16 or bf16: remove "
                "those blocks (Accelerate's mixed_precision chooses the autocast dtype)"
            )
        return "no"  # Accelerate's own autocast (native_amp) handles the forward; the engine stays fp32

    # -- prepare ---------------------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        self.state.distributed_type  # a reset AcceleratorState raises Accelerate's own error here, first
        args = list(args)
        placements = device_placement or [None] * len(args)
        for model_at, optimizer_ats in _pair_models_with_optimizers(args, self._managed):
            managed = self._setup_zero(args[model_at], [args[i] for i in optimizer_ats], placements[model_at])
            for k, optimizer_at in enumerate(optimizer_ats):
                args[optimizer_at] = managed.engine.optimizers[k]
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement=None, evaluation_mode: bool = False):
        managed = self._managed_for(model)
        if managed is None and not evaluation_mode and _trainable(model):
            managed = self._setup_zero(model, [], device_placement)  # prepared without its optimizer
        if managed is None:
            return super().prepare_model(model, device_placement, evaluation_mode)  # frozen: nothing to shard
        if model not in self._models:
            self._models.append(model)
        model._is_accelerate_prepared = True
        return self._compiled(model)

    def _compiled(self, model: nn.Module) -> nn.Module:
        """``dynamo_backend`` / the YAML's ``dynamo_config`` compile the model as plain Accelerate does, last. The
        engine's hooks stay out of the graphs, so compiled ZeRO trains as compiled DDP does."""
        plugin = self.state.dynamo_plugin
        if plugin.backend == DynamoBackend.NO or is_compiled_module(model):
            return model
        if plugin.use_regional_compilation:
            compiled = compile_regions(model, **plugin.to_kwargs())
        else:
            compiled = torch.compile(model, **plugin.to_kwargs())
        compiled._is_accelerate_prepared = True
        return compiled

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement)
        managed = next((m for m in self._managed if any(o is optimizer for o in m.engine.optimizers)), None)
        if managed is None:
            owner = next((m for m in self._managed if m.owns(_optimizer_params(optimizer))), None)
            where = "its model was prepared earlier without it" if owner else "no prepared model holds its parameters"
            raise ValueError(
                f"cannot prepare this {type(optimizer).__name__} alone under ZeRO ({where}): pass the model and its "
                "optimizer to the same accelerator.prepare(...) call"
            )
        prepared = ZeroAcceleratedOptimizer(optimizer, managed)
        managed.optimizers[managed.engine.optimizer_indices(optimizer)[0]] = prepared
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        # The scheduler was built on the user's optimizer, which is now the engine's inner optimizer.
        owner = [o for o in self._optimizers
                 if isinstance(o, ZeroAcceleratedOptimizer) and o.inner is getattr(scheduler, "optimizer", None)]
        if owner and isinstance(prepared, AcceleratedScheduler):
            prepared.optimizers = owner
        return prepared

    def _setup_zero(self, model: nn.Module, optimizers: list, device_placement) -> ManagedModel:
        placement = self.device_placement if device_placement is None else device_placement
        if placement and not _built_in_place(model):
            model.to(self.device)
        _ensure_process_group(self.device)
        has_optimizer = bool(optimizers)
        if not optimizers:  # a model prepared alone still syncs (and at stage 3 partitions) like DDP would
            optimizers = [torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)]
        cfg = run_config(self.zero_plugin.config, self._engine_precision, self.gradient_accumulation_steps, model)
        if cfg.fp16.enabled and any(m.engine.config.fp16.enabled for m in self._managed):
            raise NotImplementedError(
                "fp16 with more than one prepared model is not supported (each engine has its own loss scale "
                "and accelerator.backward cannot tell which model a loss comes from): use bf16"
            )
        engine = zero_core.setup(model, optimizers, cfg)
        if cfg.stage == 3:  # save_pretrained on one rank: a clear error (peft/transformers are imported by now)
            save_pretrained.install_if_loaded()
        _convert_io(model, cfg)
        if self.native_amp:
            _autocast_forward(model, get_mixed_precision_context_manager(self.native_amp, self.autocast_handler))
        managed = ManagedModel(model, engine, has_optimizer)
        self._managed.append(managed)
        return managed

    def _managed_for(self, model) -> Optional[ManagedModel]:
        # keep_fp32_wrapper=True: a lookup must not unwrap the autocast forward (False pops it off the model)
        target = (extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)
                  if isinstance(model, nn.Module) else model)
        return next((m for m in self._managed if m.module is model or m.module is target), None)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        managed = self._managed_for(model)
        if managed is not None and not keep_fp32_wrapper:
            _drop_autocast_forward(managed.module)
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def zero_engine(self, model: nn.Module) -> zero_core.ZeroEngine:
        """The ``zero_core.ZeroEngine`` training ``model`` (for ``comm_stats()``, ``memory_stats()``, ...)."""
        managed = self._managed_for(model)
        if managed is None:
            raise ValueError("this model was not prepared by this ZeroAccelerator")
        return managed.engine

    # -- training --------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if not self._managed:
            return super().backward(loss, **kwargs)
        loss = loss / self.gradient_accumulation_steps
        syncing = [m for m in self._managed if m.backward_syncs()]
        with contextlib.ExitStack() as stack:
            for managed in self._managed:
                managed.grads_arrived = False
                if managed not in syncing and managed.no_sync_depth == 0:
                    stack.enter_context(managed.engine.no_sync())  # DDP would not sync after a no_sync forward
            scale = next((m.engine.loss_scale for m in self._managed if m.engine.config.fp16.enabled), 1.0)
            (loss * scale if scale != 1.0 else loss).backward(**kwargs)
        for managed in self._managed:
            if managed.grads_arrived:
                _after_backward(managed, managed in syncing and self.sync_gradients)

    @contextlib.contextmanager
    def no_sync(self, model):
        managed = self._managed_for(model)
        if managed is None:
            with super().no_sync(model):
                yield
            return
        with managed.no_sync():
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        managed = self._managed_for(model)
        if managed is None:
            with Accelerator.trigger_sync_in_backward(model):
                yield
            return
        with managed.forced():
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """Accelerate's uneven-inputs context: a prepared ZeRO model (or its optimizer) joins as its engine, whose
        ranks that run out of batches join the others' steps (zero_core/join.py); other joinables are passed on
        as they are. Every rank steps every step, with one forward and backward per step (no accumulation)."""
        engines, passed_on = [], []
        for item in joinables:
            managed = self._managed_for(item) if isinstance(item, nn.Module) else self._owner_of_optimizer(item)
            if managed is None:
                passed_on.append(item)
            elif managed.engine not in engines:
                engines.append(managed.engine)
        if engines and self.gradient_accumulation_steps > 1:
            raise NotImplementedError(
                "join_uneven_inputs with a ZeRO model runs one optimizer step per forward and backward: use "
                "gradient_accumulation_steps=1 (or even_batches=True, which needs no join)"
            )
        if not engines or not self.use_distributed:
            with super().join_uneven_inputs(joinables, even_batches):
                yield
            return
        # Accelerate's own context joins only on GPUs (``multi_device``); the engine joins wherever it runs
        with _even_batches_set(self, even_batches), contextlib.ExitStack() as stack:
            passed_on = [stack.enter_context(engine.joinable()) for engine in engines] + passed_on
            with Join(passed_on, enable=not self.even_batches if even_batches is None else not even_batches,
                      throw_on_early_termination=False):
                yield

    def _owner_of_optimizer(self, optimizer) -> Optional[ManagedModel]:
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer  # wraps the engine's
        return next((m for m in self._managed if any(inner is o or optimizer is o for o in m.engine.optimizers)), None)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = list(parameters)
        managed = self._owner_of(params)
        if managed is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        given = {id(p) for p in params}
        engine = managed.engine
        for k in range(len(engine.optimizers)):  # one optimizer's parameters (e.g. a GAN's generator)
            if given == {id(p) for p in engine.trainable_params(k)}:
                return engine.clip_grad_norm_(max_norm, norm_type, optimizer=k)
        if given >= {id(p) for p in engine.trainable_params()}:
            return engine.clip_grad_norm_(max_norm, norm_type)
        raise ValueError(
            "ZeRO clips by the norm of whole optimizers' gradients (they are sharded across ranks): pass "
            "model.parameters(), or all the parameters of one of the model's optimizers"
        )

    def clip_grad_value_(self, parameters, clip_value):
        params = list(parameters)
        if self._owner_of(params) is not None:
            raise NotImplementedError("clip_grad_value_ cannot reach ZeRO's sharded gradients: use clip_grad_norm_")
        return super().clip_grad_value_(params, clip_value)

    def _owner_of(self, params) -> Optional[ManagedModel]:
        owners = [m for m in self._managed if m.owns(params)]
        if len(owners) > 1:
            raise ValueError("these parameters belong to several prepared models: clip each model separately")
        return owners[0] if owners else None

    # -- weights and checkpoints -----------------------------------------------------------------------------
    def get_state_dict(self, model, unwrap: bool = True):
        managed = self._managed_for(model)
        if managed is None:
            return super().get_state_dict(model, unwrap)
        return weights.full_state_dict(managed.engine)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        managed = self._managed_for(model)
        if managed is None:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        if not safe_serialization:
            raise ValueError("ZeroAccelerator.save_model writes safetensors only: drop safe_serialization=False")
        if os.path.isfile(save_directory):
            raise ValueError(f"save_model needs a directory, but {save_directory} is a file")
        weights.save_model(managed.engine, save_directory, max_shard_size)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        if not self._managed:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        # DeepSpeed's save_checkpoint keyword, which Accelerate passes through to it (the HF Trainer does, for PEFT)
        exclude_frozen = bool(save_model_func_kwargs.pop("exclude_frozen_parameters", False))
        with self._accelerate_objects_only():
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        state_io.save_engines(self, location, exclude_frozen_parameters=exclude_frozen)
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        if not self._managed:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            # Resume after a crash: the newest complete state, not merely the highest-numbered directory.
            checkpoints = os.path.join(self.project_dir, "checkpoints")
            input_dir = state_io.latest_state(checkpoints)
            if input_dir is None:
                raise FileNotFoundError(f"load_state(): no complete saved state in {self.project_dir}/checkpoints")
            # The next save_state goes past every directory there, the damaged ones a crash left included
            # (Accelerate refuses an existing checkpoint_<n>, and its own load_state leaves the count at 0).
            self.project_configuration.iteration = state_io.next_iteration(checkpoints)
        seen = []
        handle = self.register_load_state_pre_hook(lambda models, directory: seen.append(directory))
        try:
            with self._accelerate_objects_only():
                super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()
        state_io.load_engines(self, seen[-1])
        # At another world size: the accumulation that keeps the global batch (the HF Trainer loads through
        # hf_trainer.py, which re-plans its own TrainingArguments' accumulation instead).
        elastic.keep_global_batch(self, state_io.saved_global_batch(seen[-1]))

    @contextlib.contextmanager
    def _accelerate_objects_only(self) -> Iterator[None]:
        """Hide ZeRO models and optimizers from Accelerate's own save/load (the engines save them, sharded)."""
        models, optimizers = self._models, self._optimizers
        managed_models = {id(m.module) for m in self._managed}
        self._models = [m for m in models if id(extract_model_from_parallel(m)) not in managed_models]
        self._optimizers = [o for o in optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def free_memory(self, *objects):
        self._close_engines()
        self._managed = []
        return super().free_memory(*objects)

    def end_training(self):
        self._close_engines()  # before Accelerate destroys the process group
        return super().end_training()

    def _close_engines(self) -> None:
        """Finish every engine's in-flight collectives (engine.close; docs/reliability.md)."""
        for managed in self._managed:
            managed.engine.close()


@contextlib.contextmanager
def _even_batches_set(accelerator: Accelerator, even_batches: Optional[bool]) -> Iterator[None]:
    """``join_uneven_inputs(even_batches=...)`` overrides the prepared map-style loaders' setting for its block,
    as Accelerate's own context does, and warns as it does when some loaders are iterable-style (they have no
    batch sampler to override)."""
    saved, iterable_seen = [], False
    if even_batches is not None:
        for loader in accelerator._dataloaders:
            sampler = getattr(loader, "batch_sampler", None)
            if hasattr(sampler, "even_batches"):
                saved.append((sampler, sampler.even_batches))
                sampler.even_batches = even_batches
            else:
                iterable_seen = True
    if iterable_seen:  # Accelerate's own words (tests match them)
        warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                      "given were iterable")
    try:
        yield
    finally:
        for sampler, value in saved:
            sampler.even_batches = value


def _pair_models_with_optimizers(args: list, managed: list[ManagedModel]) -> list[tuple[int, list[int]]]:
    """(model position, its optimizers' positions) for every new trainable model in ``args``."""
    known = {id(m.module) for m in managed}
    models = [i for i, a in enumerate(args) if isinstance(a, nn.Module) and id(a) not in known
              and not getattr(a, "_is_accelerate_prepared", False) and _trainable(a)]
    owner_of = {}
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.optim.Optimizer) or getattr(arg, "_is_accelerate_prepared", False):
            continue
        params = {id(p) for p in _optimizer_params(arg)}
        owners = [m for m in models if params & {id(p) for p in args[m].parameters()}]
        if len(owners) > 1:
            raise ValueError(f"the optimizer at position {index} holds parameters of several models: under ZeRO an "
                             "optimizer belongs to one model (a model may have several optimizers)")
        if owners:
            owner_of.setdefault(owners[0], []).append(index)
    return [(m, owner_of.get(m, [])) for m in models]


def _built_in_place(model: nn.Module) -> bool:
    """Built under zero_core.Init (already partitioned where it belongs) or on the meta device (setup
    materialises it): moving it first would break either."""
    return any(zero_core.is_partitioned(p) or p.is_meta for p in model.parameters())


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _after_backward(managed: ManagedModel, step_follows: bool) -> None:
    """Stage 1 with all-reduce: make param.grad the averaged gradient right after the synchronising backward
    before a step, as DDP leaves it. (With reduce-scatter each rank would hold only its own slice averaged, so
    gradients stay local until the step; stages 2 and 3 reduce inside backward anyway.)"""
    if managed.engine.averages_whole_grads and step_follows:
        managed.engine.reduce_gradients()  # a later backward re-arms it: averaged grads average again exactly


def _convert_io(model: nn.Module, cfg) -> None:
    """16-bit engines: floating inputs are cast to the parameter dtype and floating outputs come back in fp32,
    as under Accelerate's autocast, so loops written for plain Accelerate keep working."""
    dtype = cfg.param_dtype
    if dtype == torch.float32:
        return
    if not (cfg.fp16.enabled and cfg.fp16.auto_cast):  # the engine registers the same cast for auto_cast
        model.register_forward_pre_hook(cast_floating_inputs(dtype), with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: convert_to_fp32(output))


def _autocast_forward(model: nn.Module, autocast_context) -> None:
    """What ``Accelerator.prepare_model`` does under native AMP: the forward runs in autocast and returns fp32
    (``unwrap_model(keep_fp32_wrapper=False)`` restores ``_original_forward``)."""
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):
        forward = MethodType(autocast_context(model.forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast_context(model.forward))


def _drop_autocast_forward(model: nn.Module) -> None:
    """``unwrap_model(keep_fp32_wrapper=False)``: the forward the model had at prepare, exactly. Accelerate's own
    unwrapping follows ``__wrapped__`` and so runs past an instance forward made with ``functools.wraps`` of the
    class's (TRL's fused head) down to the class's forward, losing it."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None or not _is_autocast_wrapper(model.__dict__.get("forward")):
        return  # no autocast, or a forward installed after prepare replaced the wrapper: keep it
    if getattr(original, "__self__", None) is model and original.__func__ is type(model).forward:
        model.__dict__.pop("forward", None)  # it was the class's own: no instance attribute at all, as before
    else:
        model.forward = original


def _is_autocast_wrapper(forward) -> bool:
    """What ``_autocast_forward`` installed: Accelerate's fp32-output wrapper (``__wrapped__`` marks it)."""
    return isinstance(getattr(getattr(forward, "__func__", forward), "__wrapped__", None), ConvertOutputsToFp32)


def _cpu_only_multiprocess() -> bool:
    """Launched with several processes (torchrun sets WORLD_SIZE) on a machine without CUDA."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def init_for_restart_attempt(cpu: bool, handlers=()) -> None:
    """Under torchrun / ``accelerate launch`` the process group is made here, over the restart attempt's own
    keys in the agent's store (zero_core.attempt_store), before Accelerate would make it over the plain store,
    where the ranks of a ``--max_restarts`` restart read the dead attempt's addresses and fail or hang. Without
    a torchelastic agent Accelerate makes the group as before."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    timeout = next((h.timeout for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
    store = zero_core.attempt_store(timeout)
    if store is None:
        return
    dist.init_process_group("gloo" if cpu else "cpu:gloo,cuda:nccl", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **({"timeout": timeout} if timeout else {}))


def _ensure_process_group(device: torch.device) -> None:
    """One process without a launcher: a world of one, so the engine's collectives have a group to run on."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
