"""The starter ``zero.yaml`` that ``accelerate-zero config`` writes."""

from __future__ import annotations

TEMPLATE = """\
# Launch with:  accelerate-zero launch --config {name} train.py
# In train.py:  from accelerate_zero import ZeroAccelerator as Accelerator
#
# Accelerate's usual keys (the same as `accelerate config` writes). Several processes on one machine are
# started by torchrun; without GPUs they run on the CPU with gloo.
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: {num_processes}
num_machines: 1
machine_rank: 0
main_process_port: 0          # 0: pick a free port
mixed_precision: '{mixed_precision}'         # no | bf16 | fp16: the ZeRO engine trains in it (fp32 master weights)
use_cpu: {use_cpu}

# DeepSpeed's zero_optimization block: same names, aliases and defaults (docs/config.md lists them all).
zero_optimization:
  stage: {stage}                    # 1: optimizer state sharded, 2: + gradients, 3: + parameters
  overlap_comm: null          # null: true for stage 3, false otherwise
  reduce_bucket_size: 5.0e+8
  allgather_bucket_size: 5.0e+8
  contiguous_gradients: true
{stage3}\
"""

STAGE3 = """\
  stage3_prefetch_bucket_size: 5.0e+7
  stage3_param_persistence_threshold: 1.0e+5
  stage3_max_live_parameters: 1.0e+9
  stage3_max_reuse_distance: 1.0e+9
  stage3_gather_16bit_weights_on_model_save: true   # lets accelerator.save_model gather the weights
"""


def starter_yaml(name: str, stage: int, num_processes: int, mixed_precision: str, use_cpu: bool) -> str:
    return TEMPLATE.format(
        name=name,
        stage=stage,
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_cpu=str(use_cpu).lower(),
        stage3=STAGE3 if stage == 3 else "",
    )
