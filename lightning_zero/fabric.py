"""``ZeroFabricStrategy``: Lightning Fabric on the same ZeRO engine.

    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2)   # after `import lightning_zero`
    with fabric.init_module():            # stage 3: built already partitioned
        model = MyModel()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    fabric.backward(loss); fabric.clip_gradients(model, optimizer, max_norm=1.0); optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # a sharded directory

The module is not wrapped (the engine installs its hooks in place); the optimizer Fabric returns is the
engine's facade, whose ``step()`` is the sharded step.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from torch.nn import Module
from torch.optim import Optimizer

import zero_core

from . import checkpoint_io, save_pretrained
from .activation_checkpointing import Policy, apply_activation_checkpointing, check_policy
from .config import base_config, run_config
from .deepspeed_args import apply_deepspeed_args, given_keywords
from .optimizer import optimizer_index
from .state_dict import StateDictType, checked_state_dict_type, module_state_dict
from .placement import to_device_around_partitioned
from .restarts import init_process_group
from .precision import ZeroFabricPrecision, as_zero_precision, clip_grad_value
from .strategy import SUPPORTED_ACCELERATORS, _placeholder_optimizer


class _EngineSyncControl(_BackwardSyncControl):
    def __init__(self, strategy: "ZeroFabricStrategy") -> None:
        self.strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool):
        engine = self.strategy.engine
        return engine.no_sync() if enabled and engine is not None else contextlib.nullcontext()


class ZeroFabricStrategy(DDPStrategy, _Sharded):
    """ZeRO data parallelism for Fabric; ``stage``, ``config`` and ``state_dict_type`` (what
    ``get_module_state_dict`` returns), and DeepSpeedStrategy's keywords (``reduce_bucket_size``,
    ``stage3_param_persistence_threshold``, ``loss_scale``, ...) and ``activation_checkpointing_policy`` (as
    FSDPStrategy's) as for :class:`lightning_zero.ZeroStrategy`.

    One model per strategy, set up together with its optimizers (``fabric.setup(model, optimizer)``, or several:
    ``fabric.setup(model, opt_g, opt_d)``, each stepping its own parameters), or alone for evaluation
    (``fabric.setup_module``).
    """

    def __init__(
        self,
        stage: Optional[int] = None,
        config: Optional[Union[str, dict[str, Any]]] = None,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        state_dict_type: StateDictType = "full",
        activation_checkpointing_policy: Optional[Policy] = None,
        exclude_frozen_parameters: bool = False,
        allgather_bucket_size: Optional[int] = None,
        reduce_bucket_size: Optional[int] = None,
        allgather_partitions: Optional[bool] = None,
        reduce_scatter: Optional[bool] = None,
        overlap_comm: Optional[bool] = None,
        contiguous_gradients: Optional[bool] = None,
        sub_group_size: Optional[int] = None,
        prefetch_bucket_size: Optional[int] = None,
        param_persistence_threshold: Optional[int] = None,
        model_persistence_threshold: Optional[int] = None,
        max_live_parameters: Optional[int] = None,
        max_reuse_distance: Optional[int] = None,
        stage3_prefetch_bucket_size: Optional[int] = None,
        stage3_param_persistence_threshold: Optional[int] = None,
        stage3_model_persistence_threshold: Optional[int] = None,
        stage3_max_live_parameters: Optional[int] = None,
        stage3_max_reuse_distance: Optional[int] = None,
        loss_scale: Optional[float] = None,
        initial_scale_power: Optional[int] = None,
        loss_scale_window: Optional[int] = None,
        hysteresis: Optional[int] = None,
        min_loss_scale: Optional[float] = None,
    ) -> None:
        keywords = given_keywords(locals())
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.zero_config = apply_deepspeed_args(base_config(stage, config), keywords, "ZeroFabricStrategy")
        self.state_dict_type = checked_state_dict_type(state_dict_type)
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy, "ZeroFabricStrategy")
        self.exclude_frozen_parameters = bool(exclude_frozen_parameters)  # DeepSpeed's: checkpoints only
        self._backward_sync_control = _EngineSyncControl(self)
        self._engine: Optional[zero_core.ZeroEngine] = None

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> Optional[zero_core.ZeroEngine]:
        return self._engine

    @property
    def precision(self) -> ZeroFabricPrecision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision("32-true")
        return self._precision

    @precision.setter
    def precision(self, plugin) -> None:
        self._precision = as_zero_precision(plugin, ZeroFabricPrecision)

    def setup_environment(self) -> None:
        if type(self.accelerator).__name__ not in SUPPORTED_ACCELERATORS:
            raise RuntimeError(f"ZeroFabricStrategy runs on CPUs or CUDA GPUs, not on "
                               f"{type(self.accelerator).__name__}; use Fabric(accelerator='cpu') or 'gpu'")
        super().setup_environment()
        self.precision.device_type = self.root_device.type

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        init_process_group(self)  # a restarted torchrun attempt gets its own store keys

    # -- model and optimizer -------------------------------------------------------------------------------
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler=None):
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        self._start_engine(module, optimizers)
        return module, list(self._engine.optimizers), scheduler

    def setup_module(self, module: Module) -> Module:
        """Evaluation only: the engine gets an optimizer that never steps."""
        self._start_engine(module, _placeholder_optimizer(module))
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def _start_engine(self, module: Module, optimizers) -> None:
        if self._engine is not None:
            raise RuntimeError("ZeroFabricStrategy manages one model; this strategy already set one up")
        config = run_config(self.zero_config, self.precision.precision)
        self._engine = zero_core.setup(module, optimizers, config)
        self.precision.engine = self._engine
        save_pretrained.install_if_loaded(config.stage)  # rank-0 save_pretrained at stage 3: a clear error

    def module_to_device(self, module: Module) -> None:
        # zero_core.Init already placed the partitioned parameters; everything else follows, as under DDP.
        to_device_around_partitioned(module, self.root_device)

    def module_init_context(self, empty_init: Optional[bool] = None):
        stack = contextlib.ExitStack()
        stack.enter_context(super().module_init_context(empty_init=empty_init))
        stack.enter_context(self.module_sharded_context())
        return stack

    def module_sharded_context(self):
        return zero_core.Init(config=self.zero_config) if self.stage == 3 else contextlib.nullcontext()

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The whole model on rank 0 (``state_dict_type="full"``, a collective), or ``{}`` ("sharded")."""
        module = getattr(module, "_forward_module", module)  # Fabric's wrapper, if given
        if self._engine is None or module is not self._engine.module:
            return super().get_module_state_dict(module)
        return module_state_dict(self._engine, self.state_dict_type)

    # -- training ------------------------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(tensor, module)
        self._require_engine().backward(tensor, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite: bool = True):
        engine = self._require_engine()
        norm = engine.clip_grad_norm_(float(max_norm), float(norm_type), optimizer=optimizer_index(engine, optimizer))
        if error_if_nonfinite and engine.loss_scaler is None and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({norm.item()}); "
                               "pass error_if_nonfinite=False to clip anyway")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        clip_grad_value(self._require_engine(), clip_val, optimizer)

    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.close()  # nothing in flight when the process group goes (docs/reliability.md)
        super().teardown()

    def _require_engine(self) -> zero_core.ZeroEngine:
        if self._engine is None:
            raise RuntimeError("set the model and optimizer up first: "
                               "model, optimizer = fabric.setup(model, optimizer)")
        return self._engine

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint takes no storage_options or filter: the engine "
                            "writes its sharded format itself")
        engine = self._require_engine()
        client = {k: v for k, v in state.items() if not self._is_engine_object(v)}
        client = self._convert_stateful_objects_in_state(client, filter={})
        with_optimizer = any(self._is_engine_object(v) and isinstance(v, Optimizer) for v in state.values())
        checkpoint_io.save_sharded(engine, client, Path(self.broadcast(str(path))), self.exclude_frozen_parameters,
                                   optimizer=with_optimizer)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        path = Path(self.broadcast(str(path)))
        engine = self._require_engine()
        state = {} if state is None else state
        if isinstance(state, (Module, Optimizer)):
            raise TypeError("ZeroFabricStrategy.load_checkpoint needs a state dict such as {'model': model, "
                            "'optimizer': optimizer}, not a bare module or optimizer")
        with_optimizer = any(self._is_engine_object(v) and isinstance(v, Optimizer) for v in state.values())
        if checkpoint_io.is_sharded_checkpoint(path):
            if with_optimizer and strict and not zero_core.has_optimizer_state(path):
                raise KeyError(f"the checkpoint at '{path}' holds no optimizer state (it was saved without the "
                               "optimizer in its state): load the model alone, or pass strict=False to start the "
                               "optimizer afresh")
            client = checkpoint_io.load_sharded(engine, path, with_optimizer, strict)
        elif path.is_file():
            client = self._load_full_file(engine, path, state, with_optimizer, strict, weights_only)
        else:
            raise checkpoint_io.missing_checkpoint_error(path)
        keys = [k for k in state if k in client and not self._is_engine_object(state[k])]
        missing = [k for k in state if k not in client and not self._is_engine_object(state[k])]
        if strict and missing:
            raise KeyError(f"the checkpoint at '{path}' has no {missing}; pass strict=False to skip them")
        return checkpoint_io.restore_into(state, client, keys)

    def _load_full_file(self, engine, path: Path, state: dict, with_optimizer: bool, strict: bool,
                        weights_only: Optional[bool]) -> dict:
        """A Fabric checkpoint file saved by DDP: the module's and the optimizer's entries go to the engine."""
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        model_key = next((k for k, v in state.items() if v is engine.module), None)
        if model_key is None or model_key not in checkpoint:
            raise KeyError(f"pass the model in state under the key it was saved with "
                           f"(checkpoint keys: {list(checkpoint)})")
        optimizer_state = None
        if with_optimizer:  # every optimizer of the engine, in its order, or none
            keys = [next((k for k, v in state.items() if v is o), None) for o in engine.optimizers]
            states = [checkpoint.pop(k, None) if k is not None else None for k in keys]
            if all(s is not None for s in states):
                optimizer_state = states[0] if len(states) == 1 else states
        zero_core.load_full_state_dict(engine, checkpoint.pop(model_key), optimizer_state, strict=strict)
        return checkpoint

    def _is_engine_object(self, value: Any) -> bool:
        engine = self._engine
        return engine is not None and (value is engine.module or any(value is o for o in engine.optimizers)
                                       or getattr(value, "_forward_module", None) is engine.module)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for stage in (1, 2, 3):
            name = f"zero{stage}"
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO stage {stage} (lightning_zero)", stage=stage)
