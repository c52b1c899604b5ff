"""``ZeroStrategy``: the Lightning Trainer on top of the ZeRO engine (``zero_core``).

The strategy translates and holds no ZeRO logic: at setup it hands the LightningModule and the optimizer from
``configure_optimizers`` to ``zero_core.setup``, and afterwards it routes Lightning's calls to the engine
(backward, ``no_sync`` for accumulation, clipping, the step) and checkpoints to ``zero_core.checkpoint``.
Processes, ranks and collectives for logging are DDP's (launchers, cluster environments, samplers).
docs/lightning.md is the user's guide.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import WarningCache

import zero_core

from . import checkpoint_io, save_pretrained
from .activation_checkpointing import Policy, apply_activation_checkpointing, check_policy
from .config import base_config, differing_fields, run_config
from .deepspeed_args import apply_deepspeed_args, given_keywords
from .elastic import KEY as GLOBAL_BATCH_KEY, batch_plan, keep_global_batch
from .offload_args import OFFLOAD_STRATEGIES, OffloadArg, apply_offload_args
from .state_dict import checked_state_dict_type, module_state_dict
from .optimizer import ZeroOptimizer
from .restarts import init_process_group
from .placement import is_partitioned, to_device_around_partitioned
from .precision import ZeroPrecision, as_zero_precision
from .weight_averaging import masters_take_averaged, refuse_at_stage3

_warnings = WarningCache()
SUPPORTED_ACCELERATORS = ("CPUAccelerator", "CUDAAccelerator")


class ZeroStrategy(DDPStrategy):
    """ZeRO data parallelism for the Trainer: ``Trainer(strategy="zero3")`` or ``ZeroStrategy(stage=3, config=...)``.

    Args:
        stage: ZeRO stage 1, 2 or 3; default: the config's stage, else 3.
        config: a ``zero_core.ZeroConfig``, a dict or a DeepSpeed-style JSON/YAML path (a whole DeepSpeed config or
            its ``zero_optimization`` block); default ``$LIGHTNING_ZERO_CONFIG``. Precision and gradient
            accumulation come from the Trainer ("auto" in the config takes them).
        start_method: "popen" (Lightning re-runs the script per process; torchrun and cluster launchers work
            too). "spawn"/"fork"/"forkserver" only for stages 1-2 in 32-true (see docs/lightning.md).
        state_dict_type: what ``lightning_module_state_dict()`` returns. "full" (default, as ``FSDPStrategy``):
            the whole model on rank 0 as CPU tensors, trainable parameters as their fp32 master weights (a
            collective, one parameter at a time); other ranks get ``{}``. "sharded": ``{}`` (the engine's sharded
            checkpoint holds the weights; nothing is gathered). Checkpoints are sharded directories either way.
        offload_optimizer, offload_parameters: True/"cpu"/"nvme" set the config's offload_optimizer / offload_param
            device (True means "nvme" when ``nvme_path`` is given); ``nvme_path``: their swap directory.
        resume: "latest" (the newest complete, verified checkpoint in the ModelCheckpoint's directory) or a
            directory to take it from: ``fit`` without ``ckpt_path`` resumes from there by itself, and starts
            fresh when there is none (so one script serves the first run and every restart).
        activation_checkpointing_policy: as FSDPStrategy's: the submodules whose activations are recomputed in
            backward, as a set of module classes (``{Block}``), an FSDP policy (``ModuleWrapPolicy``,
            ``CustomPolicy``) or a policy function. They run under ``zero_core.checkpointing.checkpoint``, so the
            config's ``activation_checkpointing`` block applies (``cpu_checkpointing``, ...); modules keep their
            names (no wrapper).
        keep_global_batch: a fit that resumes at another world size (``torchrun --nnodes MIN:MAX`` after a lost
            node) sets ``accumulate_grad_batches`` so that world size x accumulation is the checkpoint's again,
            or raises saying why it cannot (default True; False keeps the Trainer's accumulation).
        allgather_bucket_size, reduce_bucket_size, ..., stage3_max_reuse_distance: DeepSpeedStrategy's keywords
            (and DeepSpeed's ``stage3_*`` names), each setting the zero_optimization field of that name; None
            leaves the config's value. ``loss_scale``, ``initial_scale_power``, ``loss_scale_window``,
            ``hysteresis``, ``min_loss_scale`` set the fp16 block. A keyword the config contradicts is an error.
        The other arguments are DDP's.
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Optional[int] = None,
        config: Optional[Union[str, dict[str, Any]]] = None,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        state_dict_type: Literal["full", "sharded"] = "full",
        offload_optimizer: OffloadArg = None,
        offload_parameters: OffloadArg = None,
        nvme_path: Optional[str] = None,
        resume: Optional[str] = None,
        activation_checkpointing_policy: Optional[Policy] = None,
        keep_global_batch: bool = True,
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        zero_config = apply_deepspeed_args(base_config(stage, config), keywords)
        self.zero_config = apply_offload_args(zero_config, offload_optimizer, offload_parameters, nvme_path)
        self.state_dict_type = checked_state_dict_type(state_dict_type)
        if resume is not None and not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"ZeroStrategy(resume={resume!r}): give 'latest' (the ModelCheckpoint's directory) or "
                            "a directory of checkpoints")
        self.resume = None if resume is None else os.fspath(resume)
        self.activation_checkpointing_policy = check_policy(activation_checkpointing_policy, "ZeroStrategy")
        self.keep_global_batch = bool(keep_global_batch)
        self.exclude_frozen_parameters = bool(exclude_frozen_parameters)  # DeepSpeedStrategy's: checkpoints only
        self._forward_redirection = _ForwardRedirection()
        self._engine: Optional[zero_core.ZeroEngine] = None

    # -- what Lightning reads ------------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def engine(self) -> Optional[zero_core.ZeroEngine]:
        """The ZeRO engine, once ``fit`` (or a sharded load) set it up."""
        return self._engine

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning adds the DistributedSampler and reduces sync_dist logging only when this is True

    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = as_zero_precision(plugin, ZeroPrecision)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to receive the sharded state

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its own optimizer shards

    # -- processes -----------------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        if self._start_method != "popen":
            self._check_spawn_gives_right_results()
        super()._configure_launcher()

    def _check_spawn_gives_right_results(self) -> None:
        """The spawn launcher returns rank 0's ``state_dict()`` to the main process; that is the trained model
        only when parameters are whole and fp32."""
        precision = self.precision_plugin.precision
        if self.stage == 3 or precision != "32-true":
            raise ValueError(
                f"ZeroStrategy(start_method={self._start_method!r}) cannot work with stage {self.stage} and "
                f"precision={precision!r}: this launcher sends rank 0's module.state_dict() back to the main "
                "process, and under ZeRO stage 3 that state is partitioned, under 16-bit precision it is the "
                "16-bit copy, not the fp32 master weights. Use start_method='popen' (the default: Lightning "
                "re-runs your script per process), torchrun, or a cluster launcher."
            )

    def setup_environment(self) -> None:
        name = type(self.accelerator).__name__
        if name not in SUPPORTED_ACCELERATORS:
            raise RuntimeError(
                f"ZeroStrategy runs on CPUs (gloo) or CUDA GPUs (nccl), not on the {name}; "
                "use Trainer(accelerator='cpu') or accelerator='gpu'"
            )
        super().setup_environment()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        init_process_group(self)  # a restarted torchrun attempt gets its own store keys

    # -- model and optimizer -------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        _evaluate_without_inference_mode(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            refuse_at_stage3(trainer, self.stage)  # Lightning's WeightAveraging: the engine's average instead
            apply_activation_checkpointing(self.lightning_module, self.activation_checkpointing_policy)
        existing = zero_core.engine_of(self.lightning_module)
        if existing is not None and fitting:
            self._refit(existing, trainer)
        elif existing is not None:
            self._adopt_engine(existing)
        elif fitting:
            if self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self._module_to_device()
            self._setup_for_fit(trainer)
        elif is_partitioned(self.lightning_module):
            self._start_engine(_placeholder_optimizer(self.lightning_module), self._resolved_config(trainer))
        else:
            self._setup_plain_for_inference()
        self.setup_precision_plugin()
        if self._engine is not None:  # rank-0 save_pretrained of a stage 3 model: a clear error
            save_pretrained.install_if_loaded(self._engine.config.stage)
        if fitting and self.resume is not None:
            self._resume_by_itself(trainer)

    def _resume_by_itself(self, trainer) -> None:
        """``resume=``: restore as ``fit(ckpt_path=<newest verified checkpoint>)`` would, through the Trainer's
        checkpoint connector (Lightning has no public hook between choosing ckpt_path and restoring). Lightning's
        own restore then finds no ckpt_path and keeps what this loaded (loops and optimizers follow from it)."""
        path = checkpoint_io.newest_checkpoint(self.resume, trainer.checkpoint_callback)
        path = self.broadcast(str(path) if path is not None else None)  # rank 0's view decides
        if path is not None:
            trainer._checkpoint_connector._restore_modules_and_callbacks(path)
            self._resumed_from = path

    def _resolved_config(self, trainer) -> zero_core.ZeroConfig:
        return run_config(self.zero_config, self.precision_plugin.precision, trainer.accumulate_grad_batches)

    def _setup_for_fit(self, trainer) -> None:
        optimizers, scheduler_configs = self._configure_optimizers()
        self._start_engine(optimizers, self._resolved_config(trainer))
        self._use_optimizers(scheduler_configs)

    def _configure_optimizers(self) -> tuple[list, list]:
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if any(isinstance(o, torch.optim.LBFGS) for o in optimizers):
            raise TypeError("LBFGS re-evaluates the model inside step(); the ZeRO engine steps once over its "
                            "shards. Use another optimizer with ZeroStrategy")
        return optimizers, scheduler_configs

    def _use_optimizers(self, scheduler_configs: list) -> None:
        """Lightning steps the engine's optimizers, each over its own parameters."""
        self.optimizers = [ZeroOptimizer(self._engine, k) for k in range(len(self._engine.optimizers))]
        self.lr_scheduler_configs = scheduler_configs

    def _start_engine(self, optimizers, config: zero_core.ZeroConfig) -> None:
        self._engine = zero_core.setup(self.lightning_module, optimizers, config)
        self.precision_plugin.engine = self._engine

    def _adopt_engine(self, engine: zero_core.ZeroEngine) -> None:
        """validate/test/predict of a module already under an engine (after fit, or built partitioned)."""
        self._engine = engine
        self.precision_plugin.engine = engine

    def _refit(self, engine: zero_core.ZeroEngine, trainer) -> None:
        """Another fit of a module already under an engine (an earlier fit, or a partitioned build): the
        partitioning and the fp32 master weights stay; the optimizers and schedulers are built fresh from
        configure_optimizers, as a DDP run's second fit does."""
        config = self._resolved_config(trainer)
        changed = differing_fields(engine.config, config)
        if changed:
            raise ValueError(
                "this LightningModule is already under a ZeRO engine whose config differs from this Trainer's in "
                f"{', '.join(changed)} (stage, precision and the partitioning settings are fixed once a module is "
                "set up). Fit with the same strategy config and precision, or fit a fresh instance (resume it "
                "with fit(ckpt_path=...))"
            )
        optimizers, scheduler_configs = self._configure_optimizers()
        engine.replace_optimizers(optimizers)
        self._adopt_engine(engine)
        self._use_optimizers(scheduler_configs)

    def _module_to_device(self) -> None:
        # zero_core.Init already placed the partitioned parameters; metrics and the rest follow, as under DDP.
        to_device_around_partitioned(self.lightning_module, self.root_device)

    def _setup_plain_for_inference(self) -> None:
        """validate/test/predict of a whole model without an engine: cast like the engine would, sync rank 0."""
        module = self.lightning_module
        module.to(self.root_device)
        if self.precision_plugin.dtype != torch.float32:
            module.to(self.precision_plugin.dtype)
        if dist.is_initialized():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor.data, src=0)

    def model_to_device(self) -> None:
        self._module_to_device()

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``configure_model`` at stage 3 builds the model already partitioned (zero_core.Init)."""
        if self.stage != 3:
            yield
            return
        with zero_core.Init(config=self.zero_config):
            yield

    # -- steps ---------------------------------------------------------------------------------------------
    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if self._engine is not None and self._engine.config.stage == 3:
            # Through the module's own __call__: stage 3's root hooks mark where each step's forward starts.
            return self._forward_redirection(module, module, name, *args, **kwargs)
        return getattr(module, name)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Accumulation: micro-batches but the last keep their gradients local (``engine.no_sync``)."""
        if self._engine is None:
            yield
            return
        with self._engine.no_sync():
            yield

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        pass  # no DDP reducer to prepare

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        pass

    # -- checkpoints ---------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model on rank 0 (``state_dict_type="full"``, a collective), or ``{}`` ("sharded")."""
        if self._engine is None:
            return self.lightning_module.state_dict()
        return module_state_dict(self._engine, self.state_dict_type)

    def optimizer_state(self, optimizer) -> dict[str, torch.Tensor]:
        return {}  # saved by the engine, sharded

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not supported by ZeroStrategy: it writes "
                "the ZeRO sharded checkpoint format itself and does not use a CheckpointIO plugin"
            )
        if self._engine is None:
            return super().save_checkpoint(checkpoint, filepath)
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and self.world_size > 1:
            _warnings.warn(
                "ZeroStrategy saves each checkpoint as a sharded directory. For one file that load_from_checkpoint "
                "or a DDP run can read: python -m lightning_zero.convert <dir> <file.ckpt>"
            )
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is not None:  # what a resume at another world size needs to keep the global batch
            checkpoint[GLOBAL_BATCH_KEY] = batch_plan(self.world_size, trainer.accumulate_grad_batches)
        # weights_only (ModelCheckpoint(save_weights_only=True)): Lightning leaves the optimizers out, the engine too
        checkpoint_io.save_sharded(self._engine, checkpoint, path, self.exclude_frozen_parameters,
                                   optimizer="optimizer_states" in checkpoint)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if getattr(self, "_resumed_from", None) is not None:
            raise ValueError(f"ZeroStrategy(resume={self.resume!r}) already resumed this fit from "
                             f"'{self._resumed_from}'; fit(ckpt_path={str(checkpoint_path)!r}) names a checkpoint "
                             "too. Pass one of them")
        path = self._resume_path(Path(self.broadcast(str(checkpoint_path))))
        sharded = checkpoint_io.is_sharded_checkpoint(path)
        if not sharded and not path.is_file():
            raise checkpoint_io.missing_checkpoint_error(path)
        module = self.lightning_module
        if self._engine is None and not sharded:
            return super().load_checkpoint(path, weights_only)  # a whole model without engine: Lightning loads
        if self._engine is None:  # validate/test/predict from a sharded checkpoint: the engine reads it
            self._start_engine(_placeholder_optimizer(module), self._resolved_config(module.trainer))
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if sharded:
            checkpoint = checkpoint_io.load_sharded(self._engine, path, fitting, module.strict_loading)
            if fitting and self.keep_global_batch:
                keep_global_batch(module.trainer, checkpoint, self.world_size)
            return checkpoint
        checkpoint = self._read_file(path, weights_only)
        return checkpoint_io.load_full(self._engine, checkpoint, len(self.optimizers) if fitting else None,
                                       module.strict_loading)

    def _resume_path(self, path: Path) -> Path:
        """``ckpt_path="last"`` resolves (in Lightning) to the newest ``last*.ckpt`` of a ModelCheckpoint; under
        ZeRO it means the newest complete, verified checkpoint in that directory (zero_core.latest_checkpoint),
        so a damaged ``last.ckpt`` falls back to the one before."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None:
            return path
        last = {Path(p) for cb in trainer.checkpoint_callbacks if hasattr(cb, "_find_last_checkpoints")
                for p in cb._find_last_checkpoints(trainer)}
        if trainer.state.fn != TrainerFn.FITTING or path not in last:
            return path
        return zero_core.latest_checkpoint(path.parent) or path

    def _read_file(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        """A single-file checkpoint; with the default CheckpointIO it is memory-mapped, so each rank reads only
        the tensors it keeps instead of holding the whole model."""
        if type(self.checkpoint_io) is TorchCheckpointIO:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if self._engine is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # under an engine, load_checkpoint already put the weights in place

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # the engine loaded its shards in load_checkpoint

    def save_16bit_model(self, out_dir, dtype: Optional[str] = None, max_shard_size: Union[int, str] = "5GB") -> bool:
        """Every rank calls: the live weights as Hugging Face-style safetensors shards in ``out_dir``; ``dtype``
        "bf16"/"fp16"/"fp32" casts, None keeps the training dtype. At stage 3 the config needs
        ``stage3_gather_16bit_weights_on_model_save: true`` (as in DeepSpeed), else nothing is written (a
        warning) and this returns False."""
        if self._engine is None:
            raise RuntimeError("save_16bit_model needs the ZeRO engine: call it after (or during) fit")
        out = Path(self.broadcast(str(out_dir)))
        return zero_core.save_16bit_model(self._engine, out, dtype=dtype, max_shard_size=max_shard_size)

    # -- end -----------------------------------------------------------------------------------------------
    def on_train_end(self) -> None:
        super().on_train_end()
        masters_take_averaged(self.lightning_module.trainer, self._engine)  # after WeightAveraging's own end

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not wait for collectives another rank may never issue

    def teardown(self) -> None:
        # Unlike DDP, the module stays where the engine placed it (partitioned parameters cannot move) and the
        # engine stays attached, so test/predict after fit reuse it; close() only finishes in-flight collectives.
        if self._engine is not None:
            self._engine.close(wait=not getattr(self, "_failed", False))
        self._failed = False
        self._resumed_from = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for stage in (1, 2, 3):
            name = f"zero{stage}"
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO stage {stage} (lightning_zero)", stage=stage)
        for name, arguments in OFFLOAD_STRATEGIES.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO with offload (lightning_zero): {arguments}",
                                           **arguments)


def _placeholder_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
    """The engine needs an optimizer; evaluation never steps this one (lr 0, no state)."""
    return torch.optim.SGD([{"params": [p for p in module.parameters() if p.requires_grad]}], lr=0.0)


def _evaluate_without_inference_mode(trainer) -> None:
    """Evaluation loops run under no_grad instead of inference_mode: stage 3 gathers parameters into buffers
    during evaluation, and buffers made under inference_mode would later cut those parameters off from autograd."""
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop):
        loop.inference_mode = False
