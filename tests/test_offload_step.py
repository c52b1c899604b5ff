"""The offloaded step's copy pipeline (device 'cpu'): with the copies on a thread or inline, with gradients copied
during backward or at the step, over several tiles, with unscaling, clipping and a parameter that got no gradient,
it gives bit for bit what the engine's step without offload gives (both run torch's fused AdamW), and the part's
write-back after the step finds nothing left to do. One process: a flat group needs no process group."""

from __future__ import annotations

import torch

from zero_core.config import ZeroConfig
from zero_core.layout import compute_layout
from zero_core.offload import OptimizerOffload
from zero_core.optim.master_shards import step_in_tiles
from zero_core.replicated.flat_param_group import FlatParamGroup

SIZES = [30, 50, 7, 64, 20, 41]
BUCKET = 64
TILE = 60
USED = [True, True, False, True, True, True]  # parameter 2 got no gradient: never stepped


def flat_group() -> FlatParamGroup:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size, generator=generator).to(torch.bfloat16)) for size in SIZES]
    group = FlatParamGroup(params, [f"p{i}" for i in range(len(params))], 0, compute_layout(SIZES, 1, BUCKET),
                           rank=0, full_grads=False)
    group.build_masters(torch.float32)
    return group


def set_grads(group: FlatParamGroup, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for shard in group.grad_shards():
        shard.copy_(torch.randn(shard.shape, generator=generator).to(torch.bfloat16))


def test_offloaded_step_equals_the_step_without_offload_with_or_without_the_copy_thread():
    reference = flat_group()
    reference_optimizer = torch.optim.AdamW(reference.masters, lr=1e-2, weight_decay=0.1)
    runs = []
    for copy_thread, in_backward in ((True, False), (True, True), (False, False), (False, True)):
        group = flat_group()
        config = ZeroConfig(stage=2, offload_optimizer={"device": "cpu"}, sub_group_size=TILE)
        offload = OptimizerOffload([group], config, rank=0)
        offload.copy_thread = copy_thread
        optimizer = torch.optim.AdamW(group.masters, lr=1e-2, weight_decay=0.1)
        offload.bind([optimizer])
        runs.append((group, offload, optimizer, in_backward))
    before = reference.params[2].detach().clone()
    clip = torch.tensor(0.7)
    for step in range(3):
        set_grads(reference, step)
        step_in_tiles(reference_optimizer, [reference], [USED], 0.5, clip, TILE)
        reference.write_back_masters()
        for group, offload, optimizer, in_backward in runs:
            set_grads(group, step)
            if in_backward:
                offload.grad_reduced(group, None)  # as the reducer's hook does
            offload.step(optimizer, [group], [USED], 0.5, clip)
            assert group.master_shards.written_back, "the tiles were not written back by the step"
            group.write_back_masters()  # the runtime's after_step: skipped once
            assert not group.master_shards.written_back
            offload.forget_grads()
    for group, offload, optimizer, in_backward in runs:
        label = f"copy_thread={offload.copy_thread}, copied in backward={in_backward}"
        assert torch.equal(group.flat, reference.flat), f"{label}: parameters differ from the step without offload"
        for mine, theirs in zip(group.masters, reference.masters):
            assert torch.equal(mine.detach(), theirs.detach()), f"{label}: masters differ"
        assert torch.equal(group.params[2].detach(), before), f"{label}: the parameter without gradient changed"
        assert len(optimizer.state) == len(SIZES) - 1, f"{label}: the unused parameter got optimizer state"
        offload.close()
    assert torch.equal(reference.params[2].detach(), before)
    assert not torch.equal(reference.params[0].detach(), flat_group().params[0].detach())
