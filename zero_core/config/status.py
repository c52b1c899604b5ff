"""What lightning-zero does with each ZeroConfig field: honoured, mapped onto something equivalent (and how), or not
yet implemented. ZeroConfig.warn_unimplemented() and the Status column of docs/config.md read these tables."""

HONOURED = "honoured"
NOT_YET = "not yet implemented"


def _mapped(how: str) -> str:
    return f"mapped: {how}"


# What the engine does with each ZeroConfig field.
FIELD_STATUS = {
    "stage": HONOURED,
    "contiguous_gradients": _mapped("gradients are always copied into contiguous bucket buffers"),
    "reduce_scatter": HONOURED,
    "reduce_bucket_size": HONOURED,
    "allgather_partitions": HONOURED,
    "allgather_bucket_size": HONOURED,
    "overlap_comm": HONOURED,
    "load_from_fp32_weights": HONOURED,
    "elastic_checkpoint": _mapped("checkpoints always load at any world size"),
    "offload_param": HONOURED,
    "offload_optimizer": HONOURED,
    "sub_group_size": _mapped("the optimizer steps one piece per parameter fragment, in tiles of whole pieces up to "
                              "this many elements (on the accelerator also at most reduce_bucket_size; with NVMe "
                              "offload also at most 1M, so that the step holds a few tiles) wherever gradients "
                              "need an fp32 copy or live offloaded"),
    "prefetch_bucket_size": HONOURED,
    "param_persistence_threshold": HONOURED,
    "model_persistence_threshold": HONOURED,
    "max_live_parameters": HONOURED,
    "max_reuse_distance": HONOURED,
    "gather_16bit_weights_on_model_save": HONOURED,
    "ignore_unused_parameters": HONOURED,
    "legacy_stage1": _mapped("there is one stage 1 implementation"),
    "round_robin_gradients": NOT_YET,
    "zero_hpz_partition_size": HONOURED,
    "zero_quantized_weights": HONOURED,
    "zero_quantized_nontrainable_weights": _mapped("frozen units keep 8-bit shards (codes, per-block scales and "
                                                   "minima) in memory and gather them as such; persistent or "
                                                   "offloaded frozen units stay 16-bit"),
    "zero_quantized_gradients": HONOURED,
    "mics_shard_size": HONOURED,
    "mics_hierarchical_params_gather": HONOURED,
    "memory_efficient_linear": _mapped("stage 3 hooks never keep gathered weights for backward"),
    "pipeline_loading_checkpoint": NOT_YET,
    "override_module_apply": HONOURED,
    "leaf_module": HONOURED,
    "shard_alignment": HONOURED,
    "generation_max_live_parameters": HONOURED,
    "weights_ema_decay": HONOURED,
    "fp16": HONOURED,
    "bf16": HONOURED,
    "gradient_clipping": HONOURED,
    "gradient_accumulation_steps": _mapped("read by the front-ends; with the core API use engine.no_sync()"),
    "aio": _mapped("a thread pool doing positioned reads and writes (docs/offload.md)"),
    "checkpoint": HONOURED,
    "activation_checkpointing": _mapped("read by zero_core.checkpointing.checkpoint (and Hugging Face's gradient "
                                        "checkpointing routed through it); field by field below"),
}

# Fields of a block whose status differs from the block's own FIELD_STATUS (shown in docs/config.md).
BLOCK_FIELD_STATUS = {
    "checkpoint.tag_validation": _mapped("a checkpoint is a directory that all ranks agree on at every save step; "
                                         "there is no tag to validate"),
    "checkpoint.load_universal": _mapped("checkpoints always load at any world size and stage"),
    **{f"activation_checkpointing.{name}": HONOURED for name in (
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization", "number_checkpoints",
        "synchronize_checkpoint_boundary", "profile")},
}
