"""The offloaded Adam/AdamW step in chunks smaller than a piece, with the copies around each chunk beside it.

A 16-bit run copies each gradient into an fp32 host buffer before the step and casts each updated master back
into the model's 16-bit parameter shard after it. Stepping a whole piece (or a whole ``sub_group_size`` tile) at
once leaves nothing for the copies to overlap. Here the stepped pieces, in order, are cut into chunks (a piece may
span chunks; :func:`chunk_numel` says how large) and each chunk runs torch's fused CPU kernel
(``torch._fused_adam_`` / ``_fused_adamw_``, what ``Adam(fused=True).step()`` calls) on views of its pieces and
their state, while the neighbouring chunks' gradient copies and write-backs run (asynchronous copies to and from
an accelerator, or blocking ones on a copy thread). The kernel is elementwise, so
the result is bit for bit the whole-piece step, provided a cut inside a piece falls on a multiple of ``_ALIGN``
elements from the piece's start (the kernel computes a tensor's last ``numel % vector width`` elements on a
scalar path whose rounding differs). Used only where that kernel is what ``optimizer.step()`` would run (see
:func:`steps_fused_adam`), and by the engine only where the shards are on an accelerator: on a CPU-only run,
chunks measured no faster than whole tiles (docs/benchmarks.md). The step's hooks and the step counters LR
schedulers patch in run once per step, by a step over no parameters after the chunks. The Python work per chunk
is kept to slicing views made once per step (:class:`ChunkPlan`) and one kernel call per parameter group: it is
paid once per chunk, and on the overlapped step's thread each operation also waits for the GIL. With
``host_kernel: compiled`` the chunks run the compiled kernel of compiled_adam.py instead (16-bit gradients, one
call per piece part), on a CPU-only run too. docs/offload.md, "The CPU step".
"""

from __future__ import annotations

import bisect
import inspect
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional

import torch
import torch.optim.optimizer as torch_optimizer

from zero_core.optim.kernels import only_params
from zero_core.offload import compiled_adam
from zero_core.offload.placement import copy_between, wait_for_copies

# Elements per chunk where copies surround the step (chunk_numel): at least CHUNK, at most CHUNK_MAX (the write-back
# of one chunk, all that is left after the last kernel, then takes at most ~24 ms at 45 GB/s), and in between
# balanced by FIXED_COST_ELEMENTS: the elements whose copy takes as long as a chunk's fixed cost.
CHUNK = 1 << 20
CHUNK_MAX = 1 << 28
FIXED_COST_ELEMENTS = 1 << 22
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


def chunk_numel(total: int, cap: int = CHUNK_MAX) -> int:
    """Elements per chunk for a step of ``total`` elements with copies around it (at most ``cap``).

    k chunks cost k times a fixed amount beyond the kernel's own time (the Python that slices and calls, the
    kernel's start, the fork and join of its threads, where a join waits for any thread the scheduler took away:
    on an H200 host 0.25-0.55 ms per chunk at 1 and at 16 threads alike, measured before the Python per chunk was
    cut down; 1M-element chunks made the 16-thread step of 1.75B elements 1.32 s against 0.68 s with 8M ones), and
    they leave the write-back of the last chunk (total / k elements) to run after the last kernel. The sum is
    least at k = sqrt(total / FIXED_COST_ELEMENTS) (4M: a 0.35 ms fixed cost is the time to copy 4M fp32 elements
    at ~45 GB/s): 2 chunks for 20M elements, 7 for 200M, 20 for 1.75B, 40 for 6.58B, whatever the thread count.
    The k chunks are equal (64-element multiples, so one piece's cuts make no extra tiny chunk). A chunk no longer
    fits the last-level cache, as the first 1M-element chunks meant to: that bought less than their calls cost."""
    count = max(1, round(math.sqrt(total / FIXED_COST_ELEMENTS)))
    numel = -(-total // count)
    return min(cap, max(CHUNK, -(-numel // _ALIGN) * _ALIGN))


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
    """(dst, src) views of the spans' parts inside [lo, hi); ``spans`` in order of offset, not overlapping."""
    out = []
    index = max(0, bisect.bisect_right(spans, lo, key=lambda span: span.offset) - 1)
    for offset, dst, src in spans[index:]:
        if offset >= hi:
            break
        start, end = max(lo, offset), min(hi, offset + dst.numel())
        if start < end:
            out.append((dst[start - offset : end - offset], src[start - offset : end - offset]))
    return out


class _Kernel:
    """One group's arguments for the fused kernel, as Adam.step passes them (or, ``compiled``, for the compiled
    kernel that reads 16-bit gradients: compiled_adam.py)."""

    def __init__(self, group: dict, compiled: bool = False) -> None:
        beta1, beta2 = group["betas"]
        self.amsgrad = group["amsgrad"]
        self.compiled = compiled
        self.fn = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        lr = group["lr"]  # as of now: a tensor LR a scheduler changes in place is copied
        lr = lr.detach().clone() if torch.is_tensor(lr) else lr
        self.kwargs = dict(amsgrad=self.amsgrad, lr=lr, beta1=float(beta1), beta2=float(beta2),
                           weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                           grad_scale=None, found_inf=None)
        self.group = dict(lr=float(lr), betas=(float(beta1), float(beta2)), weight_decay=group["weight_decay"],
                          eps=group["eps"], decoupled_weight_decay=group["decoupled_weight_decay"],
                          maximize=group["maximize"])

    def run(self, rows: list, steps: list[torch.Tensor], scale: float = 1.0) -> None:
        """The kernel over ``rows`` (per piece: its parameter, gradient, moments and, with amsgrad, its maximum);
        the compiled kernel multiplies each gradient by ``scale`` as it reads it (the fused one takes them scaled)."""
        if self.compiled:
            for row, step in zip(rows, steps):  # row[4]: the 16-bit shard the kernel writes too, or None
                scalars = compiled_adam.scalars(self.group, float(step), scale)
                compiled_adam.step(row[0], row[1], row[2], row[3], scalars, row[4])
            return
        columns = tuple(zip(*rows))
        maxes = columns[4] if self.amsgrad else ()
        self.fn(columns[0], columns[1], columns[2], columns[3], maxes, steps, **self.kwargs)


def piece_kernels(optimizer: torch.optim.Optimizer, compiled: bool = False) -> dict[int, _Kernel]:
    """Each parameter's (by ``id``) group's kernel arguments, with the hyperparameters as of now."""
    return {id(p): kernel for group in optimizer.param_groups for kernel in [_Kernel(group, compiled)]
            for p in group["params"]}


def grad_factor(inv_scale: float, clip: Optional[torch.Tensor]) -> float:
    """What the compiled kernel multiplies each gradient by: the loss scale's inverse times the clip coefficient
    (unscale_and_clip's two multiplications, as one)."""
    return float(inv_scale) * (float(clip) if clip is not None else 1.0)


class ChunkPlan:
    """The step's pieces as flat views (parameter, gradient, moments), each with its group's kernel and its step
    count, made once per step so that a chunk only slices them (and passes a whole piece's views as they are)."""

    def __init__(self, pieces: list[torch.Tensor], states: list[dict], grads: list[torch.Tensor],
                 kernels: dict[int, _Kernel], grad_scale: float = 1.0,
                 outs: Optional[list[Optional[torch.Tensor]]] = None) -> None:
        self.kernels = [kernels[id(piece)] for piece in pieces]  # kernels: from piece_kernels
        self.grad_scale = grad_scale  # the compiled kernel's factor on every gradient (the fused one's are scaled)
        self.steps = [state["step"] for state in states]
        self.views = []
        for piece, state, grad, kernel in zip(pieces, states, grads, self.kernels):
            row = [piece.detach().view(-1), grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
            if kernel.amsgrad:
                row.append(state["max_exp_avg_sq"].view(-1))
            elif kernel.compiled:  # (no amsgrad there) the model's shard the kernel writes too, or None
                row.append(outs[len(self.views)] if outs is not None else None)
            self.views.append(row)
        self.sizes = [piece.numel() for piece in pieces]
        self.starts = [0] * len(pieces)
        for index in range(1, len(pieces)):
            self.starts[index] = self.starts[index - 1] + self.sizes[index - 1]
        self.one_kernel = len({id(kernel) for kernel in self.kernels}) <= 1

    def cuts(self, numel: int) -> list[tuple[int, int]]:
        """The chunks ``(lo, hi)`` of about ``numel`` elements, in order."""
        cuts = _cuts(self.starts, self.sizes, numel)
        return list(zip(cuts, cuts[1:]))

    def _parts(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(piece index, piece-local start, end) of each piece's part inside [lo, hi)."""
        starts, sizes = self.starts, self.sizes
        out = []
        index = bisect.bisect_right(starts, lo) - 1
        while index < len(starts) and starts[index] < hi:
            start = starts[index]
            a, b = max(lo - start, 0), min(hi - start, sizes[index])
            if a < b:
                out.append((index, a, b))
            index += 1
        return out

    def rows(self, lo: int, hi: int) -> list[tuple[int, list[torch.Tensor]]]:
        """(piece index, its views over the part of the piece inside [lo, hi)) for each piece there."""
        views, sizes = self.views, self.sizes
        return [(i, views[i] if b - a == sizes[i] else [t if t is None else t[a:b] for t in views[i]])
                for i, a, b in self._parts(lo, hi)]

    def grads(self, lo: int, hi: int) -> list[torch.Tensor]:
        """The gradient views over [lo, hi)."""
        return [self.views[i][1][a:b] for i, a, b in self._parts(lo, hi)]


def chunked_adam_step(optimizer: torch.optim.Optimizer, pieces: list[torch.Tensor], grads: list[torch.Tensor],
                      copies: list[Span], writes: list[Span], scale: Optional[Callable[[list[torch.Tensor]], None]],
                      pool: Optional[ThreadPoolExecutor], numel: int = CHUNK, compiled: bool = False,
                      grad_scale: float = 1.0, outs: Optional[list[Optional[torch.Tensor]]] = None) -> int:
    """Step ``pieces`` (master pieces that have Adam state) with host ``grads`` (fp32, or 16-bit for ``compiled``; one
    per piece, filled by ``copies`` and scaled in place by ``scale``, None where there is nothing to scale), in
    chunks of about ``numel`` elements, then do ``writes`` (the write-back). With ``pool`` (one thread) chunk k+1's
    copies and chunk k-1's write-back run while chunk k steps. Returns the number of chunks, or 0, having done
    nothing, when a piece has no state yet (its first step goes through ``optimizer.step()``). ``compiled``: the
    compiled kernel (compiled_adam.py) steps, multiplying each gradient by ``grad_scale`` as it reads it (``scale``
    is then None), and writing each piece's updated parameter into its ``outs`` entry too (the model's 16-bit shard
    in host memory, flat; None: ``writes`` covers it)."""
    if not pieces:
        return 0  # nothing stepped: the caller's tile loop has nothing to do either
    states = []
    for piece in pieces:
        state = optimizer.state.get(piece)
        if not state or "exp_avg" not in state:
            return 0
        states.append(state)
    plan = ChunkPlan(pieces, states, grads, piece_kernels(optimizer, compiled), grad_scale, outs)
    chunks = plan.cuts(numel)

    def bring(lo: int, hi: int) -> None:  # chunk [lo, hi)'s gradients in, unscaled and clipped
        with torch.no_grad():
            pairs = _slices(copies, lo, hi)
            for dst, src in pairs:
                copy_between(dst, src)
            wait_for_copies([src for _, src in pairs])
            if scale is not None:
                scale(plan.grads(lo, hi))

    def send(lo: int, hi: int) -> None:  # chunk [lo, hi)'s updated masters into the model's parameter shards
        with torch.no_grad():  # from pinned masters: asynchronous, cast on the accelerator (the caller waits)
            for dst, src in _slices(writes, lo, hi):
                copy_between(dst, src)

    def run(fn, *args) -> Optional[Future]:
        if pool is None:
            fn(*args)
            return None
        return pool.submit(fn, *args)

    bringing = bool(copies) or scale is not None  # else there is nothing to do before a chunk's step
    torch._foreach_add_(plan.steps, 1)  # once per piece, as Adam's step does
    pending: list[Future] = []
    arriving = None
    try:
        arriving = run(bring, *chunks[0]) if chunks and bringing else None
        with torch.no_grad():  # once for every chunk (grad mode is per thread: bring and send set their own)
            for k, (lo, hi) in enumerate(chunks):
                if arriving is not None:
                    arriving.result()
                arriving = run(bring, *chunks[k + 1]) if bringing and k + 1 < len(chunks) else None
                _step_chunk(plan, lo, hi)
                future = run(send, lo, hi) if writes else None
                if future is not None:
                    pending.append(future)
    finally:  # nothing left running on the thread, even after an error
        for future in pending + ([arriving] if arriving is not None else []):
            future.result()
    with only_params(optimizer, []):  # the step's hooks and patched counters (LR schedulers), once
        optimizer.step()
    return len(chunks)


def _step_chunk(plan: ChunkPlan, lo: int, hi: int) -> None:
    """The fused kernel over chunk [lo, hi): one call per parameter group among its pieces (the caller holds
    ``torch.no_grad()``, once for all its chunks)."""
    rows = plan.rows(lo, hi)
    if plan.one_kernel:
        plan.kernels[0].run([row for _, row in rows], [plan.steps[i] for i, _ in rows], plan.grad_scale)
        return
    by_kernel: dict[int, tuple[_Kernel, list, list]] = {}
    for index, row in rows:
        kernel = plan.kernels[index]
        entry = by_kernel.get(id(kernel))
        if entry is None:
            entry = by_kernel[id(kernel)] = (kernel, [], [])
        entry[1].append(row)
        entry[2].append(plan.steps[index])
    for kernel, group_rows, steps in by_kernel.values():
        kernel.run(group_rows, steps, plan.grad_scale)
