"""The offloaded Adam/AdamW step in chunks smaller than a piece, with the copies around each chunk beside it.

A 16-bit run copies each gradient into an fp32 host buffer before the step and casts each updated master back
into the model's 16-bit parameter shard after it. Stepping a whole piece (or a whole ``sub_group_size`` tile) at
once streams every tensor through memory three times and leaves nothing for the copies to overlap. Here the
stepped pieces, in order, are cut into chunks of about ``numel`` elements (a piece may span chunks) and each
chunk runs torch's fused CPU kernel (``torch._fused_adam_`` / ``_fused_adamw_``, what ``Adam(fused=True).step()``
calls) on views of its pieces and their state: the chunk's gradient copy and its write-back touch memory that is
still in cache, and they overlap the neighbouring chunks' step (asynchronous copies to and from an accelerator,
or blocking ones on a copy thread). The kernel is elementwise, so
the result is bit for bit the whole-piece step, provided a cut inside a piece falls on a multiple of ``_ALIGN``
elements from the piece's start (the kernel computes a tensor's last ``numel % vector width`` elements on a
scalar path whose rounding differs). Used only where that kernel is what ``optimizer.step()`` would run (see
:func:`steps_fused_adam`), and by the engine only where the shards are on an accelerator: on a CPU-only run, chunks measured no faster than whole tiles (docs/benchmarks.md). The
step's hooks and the step counters LR schedulers patch in run once per step, by a step over no parameters after
the chunks. docs/offload.md, "The CPU step".
"""

from __future__ import annotations

import bisect
import inspect
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional

import torch
import torch.optim.optimizer as torch_optimizer

from zero_core.optim.kernels import only_params
from zero_core.offload.placement import copy_between, wait_for_copies

# Elements per chunk: 4 MiB per fp32 tensor, so a chunk's gradient, master and moments (16 MiB) stay in the
# last-level cache while the chunk is copied in, stepped and written back (docs/benchmarks.md, "Offloaded step").
CHUNK = 1 << 20
_ALIGN = 64  # elements; a multiple of every vector width torch's CPU kernels use
_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)


class Span(NamedTuple):
    """A copy of ``src`` into ``dst`` (1-D, equal lengths) that covers elements ``[offset, offset + numel)`` of
    the step's sequence (the stepped pieces, concatenated in order)."""

    offset: int
    dst: torch.Tensor
    src: torch.Tensor


def steps_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` would run torch's fused Adam/AdamW kernel on every group and nothing else
    (no pre-hook that could change a group first, no GradScaler attributes, stock step)."""
    # Optimizer wraps each class's step for its hooks: compare the functions underneath.
    if not isinstance(optimizer, torch.optim.Adam) or inspect.unwrap(type(optimizer).step) is not _ADAM_STEP:
        return False
    if optimizer._optimizer_step_pre_hooks or torch_optimizer._global_optimizer_pre_hooks:
        return False
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    return all(group.get("fused") and not group.get("capturable") and not group.get("differentiable")
               for group in optimizer.param_groups)


def _cuts(starts: list[int], sizes: list[int], numel: int) -> list[int]:
    """Chunk boundaries in the step's sequence: about every ``numel`` elements, moved back inside a piece to a
    multiple of ``_ALIGN`` from its start."""
    total = starts[-1] + sizes[-1] if starts else 0
    numel = max(_ALIGN, numel // _ALIGN * _ALIGN)
    cuts, at = [0], 0
    while at + numel < total:
        target = at + numel
        index = bisect.bisect_right(starts, target) - 1
        cut = starts[index] + (target - starts[index]) // _ALIGN * _ALIGN
        at = cut if cut > at else target
        cuts.append(at)
    return cuts + [total] if total else cuts


def _slices(spans: list[Span], lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for offset, dst, src in spans:
        start, end = max(lo, offset), min(hi, offset + dst.numel())
        if start < end:
            out.append((dst[start - offset : end - offset], src[start - offset : end - offset]))
    return out


class _Kernel:
    """One group's arguments for the fused kernel, as Adam.step passes them."""

    def __init__(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        self.amsgrad = group["amsgrad"]
        self.fn = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        lr = group["lr"]  # as of now: a tensor LR a scheduler changes in place is copied
        lr = lr.detach().clone() if torch.is_tensor(lr) else lr
        self.kwargs = dict(amsgrad=self.amsgrad, lr=lr, beta1=float(beta1), beta2=float(beta2),
                           weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                           grad_scale=None, found_inf=None)


def chunked_adam_step(optimizer: torch.optim.Optimizer, pieces: list[torch.Tensor], grads: list[torch.Tensor],
                      copies: list[Span], writes: list[Span], scale: Callable[[list[torch.Tensor]], None],
                      pool: Optional[ThreadPoolExecutor], numel: int = CHUNK) -> int:
    """Step ``pieces`` (master pieces that have Adam state) with host fp32 ``grads`` (one per piece, filled by
    ``copies`` and scaled in place by ``scale``), chunk by chunk, then do ``writes`` (the write-back). With
    ``pool`` (one thread) chunk k+1's copies and chunk k-1's write-back run while chunk k steps. Returns the
    number of chunks, or 0, having done nothing, when a piece has no state yet (its first step goes through
    ``optimizer.step()``)."""
    if not pieces:
        return 0  # nothing stepped: the caller's tile loop has nothing to do either
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    kernels: dict[int, _Kernel] = {}
    states = []
    for piece in pieces:
        state = optimizer.state.get(piece)
        if not state or "exp_avg" not in state:
            return 0
        states.append(state)
    sizes = [piece.numel() for piece in pieces]
    starts = [0] * len(sizes)
    for index in range(1, len(sizes)):
        starts[index] = starts[index - 1] + sizes[index - 1]
    cuts = _cuts(starts, sizes, numel)
    chunks = list(zip(cuts, cuts[1:]))

    def bring(lo: int, hi: int) -> None:  # chunk [lo, hi)'s gradients in, unscaled and clipped
        with torch.no_grad():
            pairs = _slices(copies, lo, hi)
            for dst, src in pairs:
                copy_between(dst, src)
            wait_for_copies([src for _, src in pairs])
            scale([g for g, *_ in _segments(grads, starts, sizes, lo, hi)])

    def send(lo: int, hi: int) -> None:  # chunk [lo, hi)'s updated masters into the model's parameter shards
        with torch.no_grad():  # from pinned masters: asynchronous, cast on the accelerator (the caller waits)
            for dst, src in _slices(writes, lo, hi):
                copy_between(dst, src)

    def run(fn, *args) -> Optional[Future]:
        if pool is None:
            fn(*args)
            return None
        return pool.submit(fn, *args)

    torch._foreach_add_([state["step"] for state in states], 1)  # once per piece, as Adam's step does
    pending: list[Future] = []
    arriving = None
    try:
        arriving = run(bring, *chunks[0]) if chunks else None
        for k, (lo, hi) in enumerate(chunks):
            if arriving is not None:
                arriving.result()
            arriving = run(bring, *chunks[k + 1]) if k + 1 < len(chunks) else None
            _step_chunk(kernels, groups, pieces, states, grads, starts, sizes, lo, hi)
            future = run(send, lo, hi)
            if future is not None:
                pending.append(future)
    finally:  # nothing left running on the thread, even after an error
        for future in pending + ([arriving] if arriving is not None else []):
            future.result()
    with only_params(optimizer, []):  # the step's hooks and patched counters (LR schedulers), once
        optimizer.step()
    return len(chunks)


def _segments(tensors: list[torch.Tensor], starts: list[int], sizes: list[int], lo: int, hi: int):
    """(view of tensors[i] over the part of piece i inside [lo, hi), i, piece-local lo, piece-local hi)."""
    index = bisect.bisect_right(starts, lo) - 1
    while index < len(starts) and starts[index] < hi:
        a, b = max(lo, starts[index]) - starts[index], min(hi, starts[index] + sizes[index]) - starts[index]
        if a < b:
            yield tensors[index].view(-1)[a:b], index, a, b
        index += 1


def _step_chunk(kernels: dict, groups: dict, pieces, states, grads, starts, sizes, lo: int, hi: int) -> None:
    by_group: dict[int, list] = {}
    for grad, index, a, b in _segments(grads, starts, sizes, lo, hi):
        by_group.setdefault(id(groups[id(pieces[index])]), []).append((grad, index, a, b))
    for key, segments in by_group.items():
        kernel = kernels.get(key)
        if kernel is None:
            kernel = kernels[key] = _Kernel(groups[id(pieces[segments[0][1]])])
        view = lambda t, a, b: t.detach().view(-1)[a:b]  # noqa: E731
        params = [view(pieces[i], a, b) for _, i, a, b in segments]
        avgs = [view(states[i]["exp_avg"], a, b) for _, i, a, b in segments]
        sqs = [view(states[i]["exp_avg_sq"], a, b) for _, i, a, b in segments]
        maxes = [view(states[i]["max_exp_avg_sq"], a, b) for _, i, a, b in segments] if kernel.amsgrad else []
        steps = [states[i]["step"] for _, i, _, _ in segments]
        with torch.no_grad():
            kernel.fn(params, [g for g, *_ in segments], avgs, sqs, maxes, steps, **kernel.kwargs)
