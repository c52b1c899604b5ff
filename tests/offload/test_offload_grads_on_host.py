"""Gradient shards that live on the host once reduced (stages 2-3, ``offload_optimizer: cpu``): after backward's
copy of a unit's (stage 2: a reduce bucket's) reduced gradient to the host, the accelerator's copy gives its
memory back (grad_memory.MovedToHost; on CUDA, forced on here on the CPU with ``RELEASE_ON_CPU``), keeping its
bucket norms for clipping and fp16's overflow check. A reader that needs the shard again gets the host's values
copied back in.

Two ranks train the same steps twice in one process, with the shards moved and kept (the reference, itself tested
against DDP by the other offload tests), at each stage: bf16 with clipping from the config (at stage 3 also with
persistent units, and with ``offload_param: cpu``), fp16 with a loss scale, a user's clip by the 1-norm (a norm
not kept: the shards come back), accumulation by reducing backwards (the second reduction adds to the values
copied back in), the step overlapped with the forward, and started during backward. Every loss, parameter and
master is bit for bit the reference's, so are the clip norms and a gradient read with the debugging API between
backward and step; after backward the shards hold no memory (and the reference's do; at stage 2 the bucket
reduced last lends its shard from the reducer's staging, and holds none of its own). Setup makes no fp32 master
on the accelerator first: the masters offload takes are views of the 16-bit shards."""

from __future__ import annotations

import pytest
import torch

import zero_core
from distributed import run_distributed
from grads_moved import assert_trained_alike, train_steps
from models import build_model
from reference import make_optimizer, make_scheduler

from zero_core import grad_memory

MODEL = "transformer"
STEPS = 4
SMALL = {"stage": 3, "reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
BF16 = {"bf16": {"enabled": True}}
RUNS = {
    "bf16, clipping": ({**BF16, "gradient_clipping": 0.05}, {}),
    "fp16, loss scale, clipping": ({"fp16": {"enabled": True, "initial_scale_power": 8}, "gradient_clipping": 0.05},
                                   {}),
    "bf16, a user's 1-norm clip": (BF16, {"clip_norm_type": 1.0}),
    "bf16, accumulation by reducing backwards": (BF16, {"micro": 2}),
    "bf16, overlapped with the forward": (BF16, {"overlap": True}),
    "bf16, started during backward": ({**BF16, "offload_optimizer": {"device": "cpu", "overlap_with_backward": True}},
                                      {"overlap": True}),
    "bf16, persistent units, clipping": ({**BF16, "param_persistence_threshold": 200, "gradient_clipping": 0.05}, {}),
    "bf16, offload_param cpu, clipping": ({**BF16, "offload_param": {"device": "cpu"}, "gradient_clipping": 0.05},
                                          {}),
}
STAGE2 = {"stage": 2}  # several reduce buckets per group (reduce_bucket_size 300), each moved on its own
RUNS.update({
    "stage 2, bf16, clipping": ({**STAGE2, **BF16, "gradient_clipping": 0.05}, {}),
    "stage 2, fp16, loss scale, clipping": ({**STAGE2, "fp16": {"enabled": True, "initial_scale_power": 8},
                                             "gradient_clipping": 0.05}, {}),
    "stage 2, bf16, a user's 1-norm clip": ({**STAGE2, **BF16}, {"clip_norm_type": 1.0}),
    "stage 2, bf16, accumulation by reducing backwards": ({**STAGE2, **BF16}, {"micro": 2}),
    "stage 2, bf16, overlapped with the forward": ({**STAGE2, **BF16}, {"overlap": True}),
    "stage 2, bf16, started during backward": ({**STAGE2, **BF16, "offload_optimizer": {
        "device": "cpu", "overlap_with_backward": True}}, {"overlap": True}),
})


def train(rank: int, config: dict, moved: bool, micro: int = 1, overlap: bool = False,
          clip_norm_type: float = 0.0) -> dict:
    grad_memory.RELEASE_ON_CPU = moved  # this process only; the engine reads it as it sets up and steps
    model = build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, {"offload_optimizer": {"device": "cpu"}, **SMALL, **config})
    engine._offload.overlap = True if overlap else None
    dtype = torch.float16 if "fp16" in config else torch.bfloat16
    # (a read between backward and step: the thread started during backward refuses it)
    result = train_steps(engine, MODEL, rank, STEPS, micro, dtype, scheduler, clip_norm_type,
                         read_grad="overlap_with_backward" not in str(config))
    engine.close()
    grad_memory.RELEASE_ON_CPU = False
    return result


def equivalence_worker(rank, world_size):
    return {label: (train(rank, config, False, **options), train(rank, config, True, **options))
            for label, (config, options) in RUNS.items()}


@pytest.mark.timeout(400)
def test_gradients_moved_to_the_host_train_bit_for_bit_as_kept_ones():
    for rank, results in enumerate(run_distributed(equivalence_worker, 2, timeout=360)):
        for label, (kept, moved) in results.items():
            where = f"rank {rank}, {label}"
            assert_trained_alike(kept, moved, where, MODEL)


def setup_worker(rank, world_size):
    """What offload is given at setup: per part, whether each master bucket is a view of its 16-bit shard."""
    from zero_core.engine import facade

    seen = {}
    attach = facade.attach_offload

    def spying(runtime, config, rank):
        seen[config.stage] = [(b.dtype, b.untyped_storage().data_ptr() == s.untyped_storage().data_ptr())
                              for part in runtime.parts
                              for b, s in zip(part.master_shards.buckets, part.param_shards())]
        return attach(runtime, config, rank)

    facade.attach_offload = spying
    for stage in (2, 3):
        model = build_model(MODEL)
        engine = zero_core.setup(model, make_optimizer(model), {
            **SMALL, **BF16, "stage": stage, "offload_optimizer": {"device": "cpu"}})
        seen[f"{stage} masters"] = {m.dtype for m in engine._offload.all_masters()}
        engine.close()
    facade.attach_offload = attach
    return seen


def test_setup_makes_no_fp32_master_on_the_accelerator_before_offload_takes_it():
    for seen in run_distributed(setup_worker, 2, timeout=120):
        for stage in (2, 3):
            assert seen[stage] and all(dtype == torch.bfloat16 and view for dtype, view in seen[stage]), seen
            assert seen[f"{stage} masters"] == {torch.float32}, seen
