"""ZeroConfig: every setting of DeepSpeed's ``zero_optimization`` block plus the run-level fields
(fp16, bf16, gradient_clipping, gradient_accumulation_steps, ...) that the ZeRO engine reads.

One dataclass, one documented field per setting, DeepSpeed's names, aliases and defaults; the nested blocks are
their own dataclasses. Values are checked in ``__post_init__``; every error is a ZeroConfigError naming the field's
dotted path. ``python -m zero_core.config`` prints the field tables of docs/config.md.
"""

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional, Union

from zero_core.config.blocks import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    LeafModuleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from zero_core.config.deepspeed import (
    ALIASES,
    RUN_FIELDS,
    ZERO_SECTION,
    flatten_deepspeed_config,
    is_whole_config,
    key_path,
    normalize_names,
    pop_autos,
)
from zero_core.config.errors import ZeroConfigError, require_str_keys, unknown_key_error, warn
from zero_core.config.fields import Block, checked_init, documented, setting
from zero_core.config.files import read_config_file
from zero_core.config.status import BLOCK_FIELD_STATUS, FIELD_STATUS, NOT_YET

# Block fields of ZeroConfig: field name -> (class, may be None).
BLOCKS = {
    "leaf_module": (LeafModuleConfig, False),
    "offload_param": (OffloadParamConfig, True),
    "offload_optimizer": (OffloadOptimizerConfig, True),
    "fp16": (FP16Config, False),
    "bf16": (BF16Config, False),
    "aio": (AioConfig, False),
    "checkpoint": (CheckpointConfig, False),
    "activation_checkpointing": (ActivationCheckpointingConfig, False),
}


def _as_block(path: str, value: Any, cls, optional: bool) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, cls):
        value.validate()
        return value
    if isinstance(value, Mapping):
        return cls(**value)
    expected = f"a mapping (or {cls.__name__})" + (" or null" if optional else "")
    raise ZeroConfigError(f"{path} must be {expected}, got {value!r} ({type(value).__name__})")


def _offloads(block) -> bool:
    return block is not None and block.device != "none"


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _set_path(flat: dict, path: str, value: Any) -> None:
    root, _, leaf = path.partition(".")
    if leaf:
        flat[root][leaf] = value
    else:
        flat[root] = value


def _get_path(flat: dict, path: str) -> Any:
    root, _, leaf = path.partition(".")
    return flat[root][leaf] if leaf else flat[root]


@checked_init
@documented
@dataclass
class ZeroConfig(Block):
    """ZeRO settings: DeepSpeed's ``zero_optimization`` block plus the run-level fields the engine reads.

    Build it from keyword arguments, ``from_dict`` (a bare zero_optimization block or a whole
    DeepSpeed config), ``from_file`` (.json/.yaml/.yml) or ``coerce``. DeepSpeed's aliases
    (stage3_*) and deprecated names (cpu_offload, ...) are accepted; unknown keys are errors.
    """

    stage: int = setting(
        0, choices=(0, 1, 2, 3),
        doc="ZeRO stage: 0 off, 1 shards optimizer state, 2 also gradients, 3 also parameters.")
    contiguous_gradients: bool = setting(
        True,
        doc="Copy gradients into a contiguous buffer as they are produced, avoiding memory fragmentation.")
    reduce_scatter: bool = setting(True, doc="Average gradients with reduce-scatter instead of all-reduce.")
    reduce_bucket_size: int = setting(
        500_000_000, minimum=0,
        doc="Number of gradient elements reduced at a time; bounds the memory of the reduction buckets.")
    allgather_partitions: bool = setting(
        True,
        doc="Gather updated parameters with all-gather instead of a series of broadcasts.")
    allgather_bucket_size: int = setting(
        500_000_000, minimum=0,
        doc="Number of parameter elements all-gathered at a time.")
    overlap_comm: Optional[bool] = setting(
        None,
        doc="Overlap gradient reduction with the backward pass; null means true for stage 3 and false "
            "otherwise.")
    load_from_fp32_weights: bool = setting(
        True,
        doc="Initialise the fp32 master weights from the checkpoint's fp32 copies (no precision loss) rather "
            "than its 16-bit weights.")
    elastic_checkpoint: bool = setting(False, doc="Load checkpoints saved with a different number of ranks.")
    offload_param: Optional[OffloadParamConfig] = setting(
        None,
        doc="Offload parameters to CPU or NVMe (stage 3 only); a mapping of OffloadParamConfig fields.")
    offload_optimizer: Optional[OffloadOptimizerConfig] = setting(
        None,
        doc="Offload optimizer state and step to CPU or NVMe (stages 1-3); a mapping of "
            "OffloadOptimizerConfig fields.")
    sub_group_size: int = setting(
        1_000_000_000, minimum=0,
        doc="Tile size, in elements, of the optimizer step over very large models.")
    prefetch_bucket_size: int = setting(
        50_000_000, minimum=0,
        doc="Stage 3: maximum number of parameter elements fetched ahead of use.")
    param_persistence_threshold: int = setting(
        100_000, minimum=0,
        doc="Stage 3: parameters with fewer elements than this stay unpartitioned.")
    model_persistence_threshold: int = setting(
        sys.maxsize, minimum=0,
        doc="Stage 3: bound on the total elements that param_persistence_threshold may keep unpartitioned.")
    max_live_parameters: int = setting(
        1_000_000_000, minimum=0,
        doc="Stage 3: maximum parameter elements resident per GPU before gathered parameters are released.")
    max_reuse_distance: int = setting(
        1_000_000_000, minimum=0,
        doc="Stage 3: keep a gathered parameter that is used again within this many parameter elements.")
    gather_16bit_weights_on_model_save: bool = setting(
        False,
        doc="Stage 3: gather the partitioned 16-bit weights when the model is saved.")
    ignore_unused_parameters: bool = setting(
        True,
        doc="Accept parameters that receive no gradient instead of raising an error.")
    legacy_stage1: bool = setting(False, doc="Use DeepSpeed's old stage 1 implementation.")
    round_robin_gradients: bool = setting(
        False,
        doc="Stages 1-2 with CPU offload: spread the gradient copies to CPU memory across ranks.")
    zero_hpz_partition_size: int = setting(
        1, minimum=1,
        doc="ZeRO++ hpZ: a second copy of the 16-bit parameters partitioned over blocks of this many consecutive "
            "ranks (a node's); the backward gathers from it. 1 turns it off.")
    zero_quantized_weights: bool = setting(
        False, doc="ZeRO++ qwZ: the forward all-gather sends int8 blockwise-quantised weights; fp32 masters stay exact.")
    zero_quantized_nontrainable_weights: bool = setting(
        False,
        doc="ZeRO++: parameters without gradients (frozen, e.g. under LoRA) keep their shards as 8-bit codes "
        "with per-block scales in memory, gathered as such and dequantised.")
    zero_quantized_gradients: bool = setting(
        False, doc="ZeRO++ qgZ: gradients go through an all-to-all inside each node, then across nodes, int4 on the "
        "wire, summed in fp32.")
    mics_shard_size: int = setting(
        -1, check=lambda v: v == -1 or v >= 1, rule="-1 or >= 1",
        doc="MiCS: partition model states over blocks of this many consecutive ranks, replicated across blocks; -1: "
            "over all ranks.")
    mics_hierarchical_params_gather: bool = setting(
        False,
        doc="Gather parameters in two hops, across nodes then inside each node, when the shard group spans nodes.")
    memory_efficient_linear: bool = setting(
        True,
        doc="Stage 3: use a linear layer that does not keep gathered weights for backward.")
    pipeline_loading_checkpoint: bool = setting(
        False,
        doc="Stage 3: DeepSpeed's pipelined loading of checkpoint weights while the model is partitioned.")
    override_module_apply: bool = setting(
        True,
        doc="Stage 3: gather parameters around nn.Module.apply; false initialises faster but apply then sees "
            "partitioned parameters.")
    leaf_module: LeafModuleConfig = setting(
        factory=LeafModuleConfig,
        doc="Stage 3 leaf modules: a mapping of LeafModuleConfig fields (classes, names, name_suffixes).")
    shard_alignment: Optional[int] = setting(
        None, minimum=1,
        doc="lightning-zero's own (not DeepSpeed's): every parameter's start and every rank's shard boundary in the "
            "flat buffers (stages 1-2) and units (stage 3) fall on a multiple of this many elements, padded with "
            "zeros; null means 64 on CUDA (128 bytes for 16-bit parameters) and 1 elsewhere. Checkpoints load at "
            "any alignment.")
    generation_max_live_parameters: Optional[int] = setting(
        None, minimum=0,
        doc="lightning-zero's own: stage 3 keeps up to this many gathered parameter elements across the forward "
            "passes of generate() (and engine.generation()), instead of gathering and releasing every layer per "
            "token, and releases them when generation ends; null means max_live_parameters, 0 gathers per forward "
            "as in training.")
    weights_ema_decay: Optional[float] = setting(
        None, check=lambda v: v is None or 0.0 <= v < 1.0, rule="null or in [0, 1)",
        doc="lightning-zero's own: keep an exponential moving average of the fp32 master weights, sharded beside "
            "them and updated at each optimizer step as ema = decay * ema + (1 - decay) * weights "
            "(torch's get_ema_multi_avg_fn); null turns it off. See engine.ema_weights().")
    fp16: FP16Config = setting(factory=FP16Config, doc="Float16 mixed precision: the top-level fp16 block.")
    bf16: BF16Config = setting(
        factory=BF16Config,
        doc="BFloat16 mixed precision: the top-level bf16 (or bfloat16) block.")
    gradient_clipping: float = setting(
        0.0, minimum=0,
        doc="Clip the global gradient norm to this value; 0 turns clipping off.")
    gradient_accumulation_steps: int = setting(
        1, minimum=1,
        doc="Micro-batches whose gradients are accumulated before each optimizer step.")
    aio: AioConfig = setting(
        factory=AioConfig,
        doc="NVMe offload I/O: the top-level aio block (block_size, queue_depth, thread_count, ...).")
    checkpoint: CheckpointConfig = setting(
        factory=CheckpointConfig,
        doc="Checkpoint saving: the top-level checkpoint block (use_node_local_storage, ...).")
    activation_checkpointing: ActivationCheckpointingConfig = setting(
        factory=ActivationCheckpointingConfig,
        doc="Activation checkpoints: the top-level activation_checkpointing block (cpu_checkpointing, ...).")

    # --- construction hooks (see checked_init)

    @classmethod
    def _prepare_kwargs(cls, kwargs: dict) -> tuple:
        kwargs = normalize_names(kwargs, [f.name for f in fields(cls)])
        block_fields = {name: [f.name for f in fields(block)] for name, (block, _) in BLOCKS.items()}
        return pop_autos(kwargs, block_fields)

    def _record_given(self, names: tuple, autos: tuple) -> None:
        # Plain attributes, not fields: they stay out of __eq__, __repr__ and the CLI.
        self._explicit = frozenset(names) | {path.split(".")[0] for path in autos}
        self._auto = tuple(sorted(autos, key=field_paths().index))  # field order, not key order
        self._warned_unimplemented = False

    def _path(self, name: str) -> str:
        return key_path(name)

    def _checked(self, f: dataclasses.Field) -> Any:
        if f.name in BLOCKS:
            block, optional = BLOCKS[f.name]
            return _as_block(self._path(f.name), getattr(self, f.name), block, optional)
        return super()._checked(f)

    def _check_combinations(self) -> None:
        if _offloads(self.offload_param) and self.stage != 3:
            raise ZeroConfigError(f"{key_path('offload_param')} needs stage 3, got stage {self.stage}; "
                                  f"set {key_path('stage')} to 3 or remove offload_param")
        if _offloads(self.offload_optimizer) and self.stage == 0:
            raise ZeroConfigError(f"{key_path('offload_optimizer')} needs stage 1, 2 or 3, got stage 0; "
                                  f"set {key_path('stage')} or remove offload_optimizer")
        if self.fp16.enabled and self.bf16.enabled:
            raise ZeroConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.weights_ema_decay is not None and self.offload_optimizer is not None \
                and self.offload_optimizer.device == "nvme":
            # NVMe swaps the masters out between steps; the average would have to follow them through the files.
            raise ZeroConfigError(
                f"{key_path('weights_ema_decay')} does not combine with {key_path('offload_optimizer')}.device "
                "'nvme'; use device 'cpu' (the average then lives in host memory beside the masters) or no "
                "weights_ema_decay")
        if self.weights_ema_decay is not None and self.offload_optimizer is not None \
                and self.offload_optimizer.delayed_update_after is not None:
            # The average is updated right after the step, while the delayed step is still changing the masters.
            raise ZeroConfigError(
                f"{key_path('weights_ema_decay')} does not combine with {key_path('offload_optimizer')}"
                ".delayed_update_after; remove one of them")
        if self.offload_optimizer is not None and self.offload_optimizer.overlap_with_backward:
            self._check_overlap_with_backward()
        self._check_zeropp()

    def _check_overlap_with_backward(self) -> None:
        """A unit's step starts before backward ends: nothing may need every gradient first."""
        field = f"{key_path('offload_optimizer')}.overlap_with_backward"
        if self.fp16.enabled:
            raise ZeroConfigError(f"{field} does not combine with fp16.enabled (the loss scale's overflow check needs "
                                  "every gradient before any step); use bf16, or set overlap_with_backward: false")
        if self.gradient_clipping > 0:
            raise ZeroConfigError(f"{field} does not combine with gradient_clipping {self.gradient_clipping} (the "
                                  "global norm needs every gradient before any step); set gradient_clipping: 0 or "
                                  "overlap_with_backward: false")
        if self.stage == 1:
            raise ZeroConfigError(f"{field} needs stage 2 or 3 (stage 1 reduces every gradient at the step, "
                                  "after backward); set stage 2 or 3, or use overlap_with_forward alone")

    def _check_zeropp(self) -> None:
        """ZeRO++ works on stage 3's parameter gathers; MiCS replaces the shard group that hpZ and qgZ assume."""
        zeropp = {"zero_hpz_partition_size": self.zero_hpz_partition_size > 1,
                  "zero_quantized_weights": self.zero_quantized_weights,
                  "zero_quantized_nontrainable_weights": self.zero_quantized_nontrainable_weights,
                  "zero_quantized_gradients": self.zero_quantized_gradients}
        for name, on in zeropp.items():
            if on and self.stage != 3:
                raise ZeroConfigError(f"{key_path(name)} (ZeRO++) needs stage 3, got stage {self.stage}; set "
                                      f"{key_path('stage')} to 3 or turn {name} off")
        mics = self.mics_shard_size != -1
        for name in ("zero_hpz_partition_size", "zero_quantized_gradients"):
            if mics and zeropp[name]:
                raise ZeroConfigError(f"{key_path(name)} does not combine with {key_path('mics_shard_size')} "
                                      f"({self.mics_shard_size}): pick MiCS or hpZ/qgZ")

    # --- derived values

    @property
    def resolved_overlap_comm(self) -> bool:
        """overlap_comm with DeepSpeed's default filled in: true for stage 3, false otherwise."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def masters_offloaded(self) -> bool:
        """Whether offload_optimizer keeps the fp32 masters off the accelerator (device cpu or nvme): the runtimes
        then make none there at setup (the offload makes them in host memory from the 16-bit shards)."""
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"

    @property
    def param_dtype(self):
        """torch.float16, torch.bfloat16 or torch.float32, from fp16.enabled / bf16.enabled."""
        import torch  # lazily: reading a config should not need torch

        if self.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.bf16.enabled else torch.float32

    @property
    def auto_fields(self) -> tuple:
        """Field paths (e.g. 'reduce_bucket_size', 'fp16.enabled') given as "auto"; they hold defaults."""
        return self._auto

    # --- other constructors

    @classmethod
    def from_dict(cls, d: Mapping) -> "ZeroConfig":
        """Build from a bare zero_optimization block (optionally with the run-level fields) or from a
        whole DeepSpeed config (recognised by its top-level zero_optimization key, or by another
        DeepSpeed top-level key such as optimizer when ZeRO is off)."""
        if not isinstance(d, Mapping):
            raise ZeroConfigError(f"a ZeRO config must be a mapping, got {type(d).__name__}")
        if is_whole_config(d):
            d = flatten_deepspeed_config(d, [f.name for f in fields(cls) if f.name not in RUN_FIELDS])
        require_str_keys(d)
        return cls(**d)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "ZeroConfig":
        """Build from a .json, .yaml or .yml file holding either shape that from_dict accepts."""
        data = read_config_file(path)
        try:
            return cls.from_dict(data)
        except ZeroConfigError as err:
            raise ZeroConfigError(f"in config file '{os.fspath(path)}': {err}") from None

    @classmethod
    def coerce(cls, obj: Union["ZeroConfig", Mapping, str, os.PathLike, None], argument: str = "config") -> "ZeroConfig":
        """A ZeroConfig from a ZeroConfig (returned as is), a mapping, a file path, or None (defaults);
        ``argument`` names what was given in the error for anything else."""
        if isinstance(obj, cls):
            return obj
        if obj is None:
            return cls()
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        if isinstance(obj, (str, os.PathLike)):
            return cls.from_file(obj)
        from zero_core.describe import described  # lazily: it imports torch, which reading a config does not need

        raise TypeError(f"{argument} must be a ZeroConfig, a dict (e.g. {{'stage': 3}}), a path to a DeepSpeed "
                        f".json/.yaml/.yml file (str or os.PathLike) or None, got {described(obj)}")

    # --- output

    def _flat(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_dict(self) -> dict:
        """The whole-DeepSpeed-config shape; fields recorded as "auto" are written back as "auto"."""
        flat = self._flat()
        for path in self._auto:
            _set_path(flat, path, "auto")
        out = {ZERO_SECTION: {k: v for k, v in flat.items() if k not in RUN_FIELDS}}
        out.update({k: flat[k] for k in RUN_FIELDS})
        return out

    # --- "auto"

    def resolve_auto(self, **values: Any) -> "ZeroConfig":
        """A copy whose "auto" fields take the given run values, keyed by field path
        ('gradient_accumulation_steps', 'fp16.enabled', 'reduce_bucket_size', ...; aliases and a
        'zero_optimization.' prefix are accepted). Values for fields that are not "auto" are ignored.
        One UserWarning lists the "auto" fields left without a value and the default each keeps."""
        given = {_canonical_path(key): value for key, value in values.items()}
        flat, fallbacks = self._flat(), []
        for path in self._auto:
            if path in given:
                _set_path(flat, path, given[path])
            else:
                fallbacks.append(f"{path}={_get_path(flat, path)!r}")
        resolved = type(self)(**flat)
        resolved._explicit = self._explicit
        if fallbacks:
            warn("ZeroConfig.resolve_auto: these \"auto\" fields got no value and keep their defaults: "
                 + ", ".join(fallbacks), UserWarning)
        return resolved

    # --- implementation status

    def explicit_fields(self) -> tuple:
        """Names of the fields the user gave (directly, through an alias or a deprecated name)."""
        return tuple(f.name for f in fields(self) if f.name in self._explicit)

    def mark_given(self, *names: str) -> None:
        """Count the fields (or blocks) ``names`` as given by the user, as if written in the config: a
        front-end's keyword argument set them (``explicit_fields`` and the "not yet implemented" warning see them)."""
        self._explicit = self._explicit | set(names)

    def unimplemented_fields(self) -> tuple:
        """Explicit fields (and fields of explicit blocks, as 'block.field') set away from their default whose
        status is "not yet implemented"."""
        names = [name for name in self.explicit_fields()
                 if FIELD_STATUS[name] == NOT_YET and _differs_from_default(self, name)]
        for path, status in BLOCK_FIELD_STATUS.items():
            block, _, leaf = path.partition(".")
            if status == NOT_YET and block in self._explicit and getattr(getattr(self, block), leaf) != \
                    _default(BLOCKS[block][0], leaf):
                names.append(path)
        return tuple(names)

    def warn_unimplemented(self) -> None:
        """One UserWarning listing unimplemented_fields(); silent if there are none or already warned."""
        names = self.unimplemented_fields()
        if self._warned_unimplemented or not names:
            return
        self._warned_unimplemented = True
        listed = ", ".join(f"{key_path(name)} ({BLOCK_FIELD_STATUS.get(name) or FIELD_STATUS[name]})"
                           for name in names)
        warn(f"ZeroConfig: these settings are not implemented by lightning-zero yet and have no effect: "
             f"{listed}; docs/config.md lists the status of every field", UserWarning)


def _default(cls, name: str) -> Any:
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def _differs_from_default(cfg: ZeroConfig, name: str) -> bool:
    value = getattr(cfg, name)
    if name in ("offload_param", "offload_optimizer"):
        return _offloads(value)  # a block with device 'none' offloads nothing
    return value != _default(ZeroConfig, name)


@functools.cache
def field_paths() -> tuple:
    """Every field path of ZeroConfig in field order: 'stage', ..., 'offload_param', 'offload_param.device',
    ..., 'fp16', 'fp16.enabled', ..."""
    paths = []
    for f in fields(ZeroConfig):
        paths.append(f.name)
        if f.name in BLOCKS:
            paths += [f"{f.name}.{sub.name}" for sub in fields(BLOCKS[f.name][0])]
    return tuple(paths)


def _canonical_path(key: str) -> str:
    path = key.removeprefix(f"{ZERO_SECTION}.")
    root, dot, leaf = path.partition(".")
    path = ALIASES.get(root, root) + dot + leaf
    if path not in field_paths():
        err = unknown_key_error(key, path, field_paths())
        raise ZeroConfigError(f"resolve_auto: {err}")
    return path

