"""The offloaded step's copy pipeline (device 'cpu'): with the copies on a thread or inline, with gradients copied
during backward or at the step, over several tiles, with unscaling, clipping and a parameter that got no gradient,
it gives bit for bit what the engine's step without offload gives (both run torch's fused AdamW), and the part's
write-back after the step finds nothing left to do. With Adam or AdamW the steps after the first run in chunks
smaller than a piece where the shards are on an accelerator (forced here; chunked_step.py), with the copies on
the thread or issued inline: cut at 64-element boundaries, covering every stepped element once, and still bit for
bit the step without offload, moments included, with an LR scheduler that sees the step; on a CPU-only run the
tiles step whole, with the same result. The chunked step without copies or scaling (what benchmarks.gpu_host_step
times) is checked against optimizer.step() directly, and so is the chunk size. One process: a flat group needs no
process group."""

from __future__ import annotations

import pytest
import torch

from flat_groups import flat_group, set_grads

from zero_core.config import ZeroConfig
from zero_core.offload import OptimizerOffload, chunked_step
from zero_core.optim.master_shards import step_in_tiles

SIZES = [30, 50, 7, 64, 20, 41]
BUCKET = 64
TILE = 60
USED = [True, True, False, True, True, True]  # parameter 2 got no gradient: never stepped


def test_offloaded_step_equals_the_step_without_offload_with_or_without_the_copy_thread():
    reference = flat_group(SIZES, BUCKET)
    reference_optimizer = torch.optim.AdamW(reference.masters, lr=1e-2, weight_decay=0.1)
    runs = []
    for copy_thread, in_backward in ((True, False), (True, True), (False, False), (False, True)):
        group = flat_group(SIZES, BUCKET)
        config = ZeroConfig(stage=2, offload_optimizer={"device": "cpu"}, sub_group_size=TILE)
        offload = OptimizerOffload([group], config, rank=0)
        offload.copy_thread = copy_thread
        optimizer = torch.optim.AdamW(group.masters, lr=1e-2, weight_decay=0.1)
        offload.swapped.bind([optimizer])
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
    assert not torch.equal(reference.params[0].detach(), flat_group(SIZES, BUCKET).params[0].detach())


CHUNK_SIZES = [200, 130, 7, 64, 300, 45]  # pieces above the chunk: cut inside, on 64-element boundaries
CHUNK_USED = [True, True, True, False, True, True]


def chunked_vs_reference(make_optimizer, mode: str, monkeypatch) -> None:
    """Five steps with a scheduler, clipping and unscaling: the offloaded step in 96-element chunks (pieces of
    130-300 elements are cut) gives bit for bit the engine's step without offload, and the scheduler sees the
    optimizer step (no 'lr_scheduler.step() before optimizer.step()' warning)."""
    import warnings

    reference = flat_group(CHUNK_SIZES, 256, seed=1)
    reference_optimizer = make_optimizer(reference.masters)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=2, gamma=0.5)
    group = flat_group(CHUNK_SIZES, 256, seed=1)
    config = ZeroConfig(stage=2, offload_optimizer={"device": "cpu"}, sub_group_size=250)
    offload = OptimizerOffload([group], config, rank=0)
    # "auto": what a CPU-only run does (whole tiles, inline); "thread": chunks with the copies on the copy thread
    # (pageable memory beside an accelerator); "inline": chunks with the copies issued inline (pinned memory)
    offload.chunked = None if mode == "auto" else True
    offload.copy_thread, offload.chunk_numel = mode == "thread", 96
    optimizer = make_optimizer(group.masters)
    offload.swapped.bind([optimizer])
    chunks: list[tuple[int, int]] = []  # (lo, hi) of each chunk stepped, in the step's sequence of pieces
    step_chunk = chunked_step._step_chunk
    monkeypatch.setattr(chunked_step, "_step_chunk",
                        lambda *args: (chunks.append(args[-2:]), step_chunk(*args))[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler's warning when it thinks the optimizer never stepped
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for step in range(5):
            for target in (reference, group):
                set_grads(target, step)
            step_in_tiles(reference_optimizer, [reference], [CHUNK_USED], 0.25, torch.tensor(0.6), 250)
            reference.write_back_masters()
            reference_scheduler.step()
            offload.step(optimizer, [group], [CHUNK_USED], 0.25, torch.tensor(0.6))
            group.write_back_masters()
            offload.forget_grads()
            scheduler.step()
    label = f"{type(optimizer).__name__}, {mode}"
    compare(label, group, reference, optimizer, reference_optimizer)
    offload.close()
    if mode == "auto":  # shards in host memory (a CPU-only run): tiles step whole, as measured faster there
        assert chunks == [] and offload.chunks_stepped == 0, f"{label}: chunks {chunks}"
        return
    # The first step creates the state through optimizer.step(); the four others go in chunks of <= 96 elements
    # covering every stepped element once, some cut inside a piece, 64-element aligned from the piece's start.
    used = [size for size, on in zip(CHUNK_SIZES, CHUNK_USED) if on]
    starts = [sum(used[:i]) for i in range(len(used))]
    assert len(chunks) == offload.chunks_stepped and len(chunks) % 4 == 0, f"{label}: {len(chunks)} chunks"
    per_step = chunks[: len(chunks) // 4]
    assert per_step[0][0] == 0 and per_step[-1][1] == sum(used), f"{label}: chunks {per_step}"
    assert all(a[1] == b[0] for a, b in zip(per_step, per_step[1:])), f"{label}: chunks {per_step} leave gaps"
    assert max(hi - lo for lo, hi in per_step) <= 96, f"{label}: a chunk above 96 elements: {per_step}"
    inside = [(lo, start) for lo, _ in per_step for start, size in zip(starts, used) if start < lo < start + size]
    assert inside and all((lo - start) % 64 == 0 for lo, start in inside), f"{label}: cuts {per_step}"


def compare(label: str, group, reference, optimizer, reference_optimizer) -> None:
    """Parameters, masters and every state tensor bit for bit; the parameter without gradient has no state."""
    assert torch.equal(group.flat, reference.flat), f"{label}: parameters differ from the step without offload"
    for mine, theirs in zip(group.masters, reference.masters):
        assert torch.equal(mine.detach(), theirs.detach()), f"{label}: masters differ"
        if optimizer.state.get(mine):
            for key, value in optimizer.state[mine].items():
                assert torch.equal(value, reference_optimizer.state[theirs][key]), f"{label}: state {key} differs"
    assert not optimizer.state.get(group.masters[3]), f"{label}: the parameter without gradient got state"


@pytest.mark.parametrize("mode", ["auto", "thread", "inline"])
@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.9), maximize=True),
    # pieces of two groups alternate, so a chunk holds both: one kernel call per group, each with its own decay
    lambda p: torch.optim.AdamW([{"params": p[::2]}, {"params": p[1::2], "weight_decay": 0.0}], lr=1e-2,
                                weight_decay=0.1),
], ids=["adamw", "adam-l2-amsgrad", "adam-maximize", "adamw-two-groups"])
def test_chunked_step_cuts_pieces_and_equals_the_step_without_offload(make_optimizer, mode, monkeypatch):
    chunked_vs_reference(make_optimizer, mode, monkeypatch)


def test_chunked_adam_step_with_nothing_to_copy_or_scale_equals_the_whole_step():
    """The chunked step's bare path (no copies, no unscaling or clipping: nothing runs around a chunk's kernel),
    in 96-element chunks over two groups with amsgrad on one, bit for bit ``optimizer.step()``; and the chunk
    size for a step with copies: k = sqrt(elements / FIXED_COST_ELEMENTS) equal 64-element multiples, within
    [CHUNK, cap]."""
    import math

    sizes = [300, 130, 7, 200]
    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(size, generator=generator) for size in sizes]
    runs = []
    for _ in range(2):
        params = [torch.nn.Parameter(value.clone()) for value in values]
        optimizer = torch.optim.Adam([{"params": params[::2], "amsgrad": True}, {"params": params[1::2]}],
                                     lr=1e-2, weight_decay=0.1, fused=True)
        runs.append((params, optimizer))
    chunk_counts = []
    for step in range(4):
        grads = [torch.randn(size, generator=generator) for size in sizes]
        for index, (params, optimizer) in enumerate(runs):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            if index == 0 or step == 0:  # the first step makes the state
                optimizer.step()
            else:
                chunk_counts.append(chunked_step.chunked_adam_step(
                    optimizer, params, [p.grad for p in params], [], [], None, None, 96))
    (mine, ours), (theirs, reference) = runs[1], runs[0]
    assert chunk_counts == [len(chunked_step._cuts([0, 300, 430, 437], sizes, 96)) - 1] * 3, chunk_counts
    for a, b in zip(mine, theirs):
        assert torch.equal(a.detach(), b.detach()), "parameters differ from optimizer.step()"
        for key, value in ours.state[a].items():
            assert torch.equal(value, reference.state[b][key]), f"state {key} differs from optimizer.step()"
    assert chunked_step.chunk_numel(700, 96) == 96
    for total in (5 * 10**5, 2 * 10**7, 2 * 10**8, 175 * 10**7):
        numel = chunked_step.chunk_numel(total)
        count = max(1, round(math.sqrt(total / chunked_step.FIXED_COST_ELEMENTS)))
        assert numel % 64 == 0 and chunked_step.CHUNK <= numel <= chunked_step.CHUNK_MAX, (total, numel)
        assert math.ceil(total / numel) == (count if total > chunked_step.CHUNK else 1), (total, numel, count)
