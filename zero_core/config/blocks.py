"""The blocks nested in ZeroConfig, one dataclass each: offload_param and offload_optimizer inside
``zero_optimization``, leaf_module, and the top-level fp16, bf16, aio, checkpoint and activation_checkpointing blocks
of a DeepSpeed config. DeepSpeed's names and defaults; every error names the field's dotted path."""

from dataclasses import dataclass
from typing import ClassVar, Optional

from zero_core.config.deepspeed import ZERO_SECTION
from zero_core.config.errors import ZeroConfigError
from zero_core.config.fields import Block, checked_init, documented, setting

# What DeepSpeed declares leaves by default: Hugging Face's sparse MoE blocks, which loop over their experts. Plain
# class names: stage 3 matches them against the model's modules.
DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def _check_nvme(block) -> None:
    if block.device == "nvme" and not block.nvme_path:
        raise ZeroConfigError(f"{block._PATH}.nvme_path is required when device is 'nvme'; "
                              f"set it to a directory on the NVMe drive, or use device 'cpu'")


@checked_init
@documented
@dataclass
class OffloadParamConfig(Block):
    """Parameter offload (``zero_optimization.offload_param``); DeepSpeed allows it with stage 3 only."""

    _PATH: ClassVar[str] = f"{ZERO_SECTION}.offload_param"

    device: str = setting(
        "none", choices=OFFLOAD_DEVICES,
        doc="Where to offload parameters: none, cpu or nvme.")
    nvme_path: Optional[str] = setting(None, doc="Directory on the NVMe drive; required when device is nvme.")
    buffer_count: int = setting(5, minimum=0, doc="Number of buffers in the pool for NVMe parameter offload.")
    buffer_size: int = setting(100_000_000, minimum=0, doc="Size in elements of each NVMe offload buffer.")
    max_in_cpu: int = setting(
        1_000_000_000, minimum=0,
        doc="Number of parameter elements kept in CPU memory when offloading to NVMe.")
    pin_memory: bool = setting(
        False,
        doc="Offload to page-locked CPU memory: faster copies, more host memory.")

    def _check_combinations(self) -> None:
        _check_nvme(self)


@checked_init
@documented
@dataclass
class OffloadOptimizerConfig(Block):
    """Optimizer-state offload (``zero_optimization.offload_optimizer``); stages 1, 2 and 3."""

    _PATH: ClassVar[str] = f"{ZERO_SECTION}.offload_optimizer"

    device: str = setting(
        "none", choices=OFFLOAD_DEVICES,
        doc="Where to offload optimizer state: none, cpu or nvme; the step runs on the CPU.")
    nvme_path: Optional[str] = setting(None, doc="Directory on the NVMe drive; required when device is nvme.")
    buffer_count: int = setting(
        4, minimum=0,
        doc="Number of buffers for NVMe offload; at least the optimizer's states per parameter (Adam: 4).")
    pin_memory: bool = setting(
        False,
        doc="Offload to page-locked CPU memory: faster copies, more host memory.")
    pipeline_read: bool = setting(
        False,
        doc="Overlap reading the next tile with the step on the current one.")
    pipeline_write: bool = setting(
        False,
        doc="Overlap writing the previous tile with the step on the current one.")
    fast_init: bool = setting(False, doc="Fast optimizer initialisation when offloading to NVMe.")
    delayed_update_after: Optional[int] = setting(
        None, check=lambda v: v is None or v >= 0,
        rule="null or an int >= 0",
        doc="lightning-zero's own, device cpu only: after this many exact steps, each host step runs in the "
            "background while the next forward and backward run, which use the weights from one step earlier "
            "(the ZeRO-Offload paper's one-step delayed parameter update); null keeps every step exact. "
            "docs/offload.md, \"Delayed parameter update\".")

    overlap_with_forward: Optional[bool] = setting(
        None,
        doc="lightning-zero's own: the host step runs on a thread while the next forward starts, each part's "
            "update written into the model in the order the forward reads it and waited for there (the maths "
            "unchanged; acts where the shards are on an accelerator). null (the default): on with device cpu at "
            "stage 3; off with nvme (whose gradients would then wait in host memory for the step) and at stages "
            "1-2 (whose step call all-gathers every group after the step, so nothing overlaps); true / false: "
            "on / off. docs/offload.md, \"The step overlapped with the next forward\".")
    overlap_with_backward: bool = setting(
        False,
        doc="lightning-zero's own, opt-in, device cpu at stages 2-3: as overlap_with_forward, and each unit's "
            "(stage 2: each reduce bucket's) host step starts as soon as backward has reduced its gradients, while "
            "backward goes on (the maths "
            "unchanged where it applies: no gradient clipping, no fp16 loss scaling, step() after every "
            "backward that reduces). 6.58B on one H200: 1.83 s a step against 2.15 s inline. docs/offload.md, "
            "\"The step started during backward\".")

    host_kernel: str = setting(
        "fused", choices=("fused", "compiled"),
        doc="lightning-zero's own, device cpu: the kernel of the host Adam/AdamW step. fused (the default): torch's "
            "fused CPU kernel, which takes fp32 gradients, so 16-bit gradients are copied into fp32 host buffers. "
            "compiled: a kernel torch.compile generates (needs a C++ compiler at run time) that reads the "
            "gradients in the model's dtype: half the gradient bytes copied to and held in host memory, no cast "
            "on a CPU-only run; Adam and AdamW without amsgrad; not bit for bit the fused kernel (~1e-9 apart a "
            "step). docs/offload.md, \"The compiled host kernel\".")

    def _check_combinations(self) -> None:
        _check_nvme(self)
        if self.host_kernel == "compiled" and self.device != "cpu":
            raise ZeroConfigError(
                f"{self._PATH}.host_kernel 'compiled' needs {self._PATH}.device 'cpu', got {self.device!r} (with "
                "nvme the step reads fp32 gradient tiles); set device 'cpu' or host_kernel 'fused'")
        if self.host_kernel == "compiled" and self.delayed_update_after is not None:
            raise ZeroConfigError(
                f"{self._PATH}.host_kernel 'compiled' does not combine with {self._PATH}.delayed_update_after (the "
                "delayed update steps with torch's kernel); remove one of them")
        if self.overlap_with_backward and self.device != "cpu":
            raise ZeroConfigError(
                f"{self._PATH}.overlap_with_backward needs {self._PATH}.device 'cpu', got {self.device!r} (with "
                "nvme the step swaps tiles in order after backward); set device 'cpu' or remove "
                "overlap_with_backward (overlap_with_forward works with nvme)")
        if self.delayed_update_after is not None and self.device != "cpu":
            raise ZeroConfigError(
                f"{self._PATH}.delayed_update_after needs {self._PATH}.device 'cpu', got {self.device!r} (the "
                "delayed step runs on host masters; NVMe swaps them tile by tile); set device 'cpu' or remove "
                "delayed_update_after")


@checked_init
@documented
@dataclass
class FP16Config(Block):
    """Float16 mixed precision with loss scaling (the top-level ``fp16`` block of a DeepSpeed config)."""

    _PATH: ClassVar[str] = "fp16"

    enabled: bool = setting(False, doc="Train with float16 parameters and dynamic or static loss scaling.")
    auto_cast: bool = setting(False, doc="Cast the inputs of the model's forward to float16.")
    loss_scale: float = setting(0.0, minimum=0, doc="Static loss scale; 0 means dynamic loss scaling.")
    initial_scale_power: int = setting(16, minimum=0, doc="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = setting(
        1000, minimum=1,
        doc="Steps without overflow before the dynamic loss scale is raised.")
    hysteresis: int = setting(
        2, minimum=1,
        doc="Overflows tolerated before the dynamic loss scale is lowered.")
    consecutive_hysteresis: bool = setting(
        False,
        doc="Refill the hysteresis after each step without overflow.")
    min_loss_scale: float = setting(1.0, above=0, doc="Lower bound of the dynamic loss scale.")


@checked_init
@documented
@dataclass
class BF16Config(Block):
    """BFloat16 mixed precision (the top-level ``bf16`` block; DeepSpeed also reads ``bfloat16``)."""

    _PATH: ClassVar[str] = "bf16"

    enabled: bool = setting(False, doc="Train with bfloat16 parameters (no loss scaling needed).")


@checked_init
@documented
@dataclass
class AioConfig(Block):
    """Asynchronous I/O for NVMe offload (the top-level ``aio`` block); served by a thread pool."""

    _PATH: ClassVar[str] = "aio"

    block_size: int = setting(1_048_576, above=0, doc="Bytes per read or write request.")
    queue_depth: int = setting(8, minimum=1, doc="Requests of one transfer in flight per thread.")
    thread_count: int = setting(1, minimum=1, doc="I/O threads.")
    single_submit: bool = setting(False, doc="Submit requests one at a time instead of in batches.")
    overlap_events: bool = setting(True, doc="Overlap NVMe transfers with the optimizer step and read parameter "
                                   "shards ahead of their gather; with an accelerator, copy offloaded tiles on a thread.")


@checked_init
@documented
@dataclass
class CheckpointConfig(Block):
    """Checkpoint saving (the top-level ``checkpoint`` block); docs/checkpoints.md."""

    _PATH: ClassVar[str] = "checkpoint"

    tag_validation: str = setting("Warn", choices=("Ignore", "Warn", "Fail"),
                                  doc="DeepSpeed's check that all ranks save under the same tag.")
    load_universal: bool = setting(False, doc="DeepSpeed: load a universal (world-size independent) checkpoint.")
    use_node_local_storage: bool = setting(
        False,
        doc="Each node writes only its own ranks' files, and its own manifest, to the checkpoint path on its own "
            "(not shared) disk; `zero-checkpoint gather` joins the node directories into one checkpoint.")


@checked_init
@documented
@dataclass
class LeafModuleConfig(Block):
    """Stage 3 leaf modules (``zero_optimization.leaf_module``): a leaf's whole subtree is gathered and released as
    one unit, so children that run on some ranks only need no collective of their own (docs/stage3.md)."""

    _PATH: ClassVar[str] = f"{ZERO_SECTION}.leaf_module"

    classes: list[str] = setting(
        factory=lambda: list(DEFAULT_LEAF_CLASSES),
        doc="Module classes to make leaves, by class name or dotted path; by default Hugging Face's Mixtral, "
            "Qwen2-MoE and Qwen3-MoE sparse MoE blocks, as in DeepSpeed.")
    names: list[str] = setting(factory=list, doc="Module names (as in model.named_modules()) to make leaves.")
    name_suffixes: list[str] = setting(factory=list, doc="Make leaves of the modules whose name ends with one of these.")


@checked_init
@documented
@dataclass
class ActivationCheckpointingConfig(Block):
    """Activation checkpoints (the top-level ``activation_checkpointing`` block): how the inputs that
    ``zero_core.checkpointing.checkpoint`` keeps for recomputation are held (docs/stage3.md, "Activation
    checkpoints")."""

    _PATH: ClassVar[str] = "activation_checkpointing"

    partition_activations: bool = setting(
        False,
        doc="Keep 1/N of each checkpointed input on each of the N ranks of the model-parallel group given to "
            "zero_core.checkpointing.configure(mpu_), gathered back before recomputation; an error without one "
            "(data-parallel ranks hold no redundant activations).")
    cpu_checkpointing: bool = setting(
        False,
        doc="Keep each checkpointed input in host memory (pinned with CUDA) and bring it back ahead of its "
            "recomputation (on a side stream with CUDA).")
    contiguous_memory_optimization: bool = setting(
        False,
        doc="Copy the checkpointed inputs into one buffer allocated once (number_checkpoints slots), so they "
            "do not fragment memory.")
    number_checkpoints: Optional[int] = setting(
        None, minimum=1,
        doc="Checkpoints per forward pass: the slots of the contiguous_memory_optimization buffer.")
    synchronize_checkpoint_boundary: bool = setting(
        False,
        doc="Synchronize the accelerator at the start and end of each checkpoint's forward and recomputation.")
    profile: bool = setting(False, doc="Time each checkpointed function's forward and recomputation; rank 0 logs "
                            "a summary per forward-backward pass (logger zero_core.checkpointing, INFO).")

    def _check_combinations(self) -> None:
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ZeroConfigError(f"{self._PATH}.contiguous_memory_optimization needs {self._PATH}."
                                  "number_checkpoints (the checkpoints per forward pass: the buffer's slots)")

