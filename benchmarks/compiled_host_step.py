"""Would a code-generated host step cut the offloaded step's memory traffic? (issue 38)

The offloaded step moves, per element of host memory: 28 bytes in torch's fused CPU AdamW (fp32 parameter and
both moments read and written, the fp32 gradient read), 4 for the gradient's copy in from the GPU (fp32, cast on
the GPU, since the kernel takes one dtype) and 4 for the write-back's copy out (fp32, cast on the GPU): 36. The
kernel is bound by the host's memory bandwidth (``python -m benchmarks.host_bandwidth``), so when the step runs
beside backward's gradient copies (``overlap_with_backward``) those bytes cost it time. torch has no kernel that
reads a 16-bit gradient; ``torch.compile`` (inductor's CPU code generation, needs a C++ compiler) can make one.
This times, on the same fp32 state:

- ``fused``: ``torch._fused_adamw_`` with an fp32 gradient (the engine's host step): 28 B in the kernel, 4 + 4
  copied, 36 B per element;
- ``compiled``: AdamW written out (torch's formula) and compiled, bf16 gradient in, fp32 master and moments
  updated in place: 26 B in the kernel, 2 + 4 copied (the write-back still reads the fp32 master), 32 B;
- ``compiled+out``: the same, also writing the bf16 parameter for a 2-byte write-back: 28 B, 2 + 2, 32 B.

With a GPU, ``--with-copies`` adds each variant with its two copies running beside the kernel (the gradient from
the GPU, the write-back to it, each on its own stream, in the variant's dtypes): the time until all three are
done, as when the step starts during backward and its write-back overlaps it.

    python -m benchmarks.compiled_host_step --numel 2e7 --threads 2 1
    python -m benchmarks.compiled_host_step --numel 1e9 --threads 16 15 --with-copies    # a GPU machine

Best of ``--repeats`` after a warm-up, the variants taking turns. Not bit for bit torch's kernel (another order
of operations): the max difference of the parameters from ``fused``'s after one step of each, on the same
gradient, is printed.
"""

from __future__ import annotations

import argparse
import shutil
from typing import Callable, Optional

import torch

from benchmarks.gpu_host_step import _best  # the fastest of repeated calls, the variants taking turns

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-4, 0.9, 0.999, 1e-8, 0.01
# bytes per element: (in the kernel, the gradient's copy in, the write-back's copy out)
BYTES = {"fused": (28, 4, 4), "compiled": (26, 2, 4), "compiled+out": (28, 2, 2)}


def _mixed_adamw(param, avg, sq, grad16, out16, step_size, bias2_sqrt) -> None:
    """One AdamW step (torch's formula) on fp32 state with a 16-bit gradient; the 16-bit parameter written too
    unless ``out16`` is None."""
    grad = grad16.float()
    new_avg = avg * BETA1 + grad * (1 - BETA1)
    new_sq = sq * BETA2 + grad * grad * (1 - BETA2)
    new_param = param * (1 - LR * WEIGHT_DECAY) - step_size * new_avg / (new_sq.sqrt() / bias2_sqrt + EPS)
    avg.copy_(new_avg)
    sq.copy_(new_sq)
    param.copy_(new_param)
    if out16 is not None:
        out16.copy_(new_param)


class _State:
    """One fp32 parameter with its moments and the gradients and outputs every variant reads or writes."""

    def __init__(self, numel: int, seed: int = 0, pinned: bool = False) -> None:
        gen = torch.Generator().manual_seed(seed)

        def empty(dtype: torch.dtype = torch.float32) -> torch.Tensor:  # pinned: what the copies read and write
            return torch.empty(numel, dtype=dtype, pin_memory=pinned)

        self.param = empty().normal_(generator=gen)
        self.avg, self.sq = empty().zero_(), empty().zero_()
        self.grad16 = empty(torch.bfloat16).copy_(torch.randn(numel, generator=gen).mul_(1e-3))
        self.grad32 = empty().copy_(self.grad16)
        self.out16 = empty(torch.bfloat16)
        self.step = torch.zeros(())
        self.count = 0


def _variants(state: _State, compiled: Callable) -> dict[str, Callable[[], None]]:
    def fused() -> None:
        state.step.add_(1)  # as Adam.step does before its kernel
        torch._fused_adamw_([state.param], [state.grad32], [state.avg], [state.sq], [], [state.step], amsgrad=False,
                            lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY, eps=EPS, maximize=False,
                            grad_scale=None, found_inf=None)

    def mixed(out16: Optional[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            state.count += 1
            step_size = torch.tensor(LR / (1 - BETA1 ** state.count))  # tensors: one kernel for every step
            bias2_sqrt = torch.tensor((1 - BETA2 ** state.count) ** 0.5)
            compiled(state.param, state.avg, state.sq, state.grad16, out16, step_size, bias2_sqrt)
        return run

    return {"fused": fused, "compiled": mixed(None), "compiled+out": mixed(state.out16)}


def _with_copies(state: _State, runs: dict[str, Callable[[], None]]) -> dict[str, Callable[[], None]]:
    """Each run with its gradient's copy from the GPU and its write-back's copy to the GPU beside it."""
    numel = state.param.numel()
    gpu = {torch.float32: (torch.full((numel,), 1e-3, device="cuda"), torch.empty(numel, device="cuda")),
           torch.bfloat16: (torch.full((numel,), 1e-3, device="cuda", dtype=torch.bfloat16),
                            torch.empty(numel, device="cuda", dtype=torch.bfloat16))}
    into, out_of = torch.cuda.Stream(), torch.cuda.Stream()
    sources = {"fused": (state.grad32, state.param), "compiled": (state.grad16, state.param),
               "compiled+out": (state.grad16, state.out16)}

    def beside(name: str, run: Callable[[], None]) -> Callable[[], None]:
        grad, written = sources[name]

        def go() -> None:
            with torch.cuda.stream(into):
                grad.copy_(gpu[grad.dtype][0], non_blocking=True)
            with torch.cuda.stream(out_of):
                gpu[written.dtype][1].copy_(written, non_blocking=True)
            run()
            torch.cuda.synchronize()
        return go

    return {f"{name} with copies": beside(name, run) for name, run in runs.items()}


def difference(numel: int = 1 << 20) -> dict[str, float]:
    """Max |parameter - fused's| after one step of each compiled variant from the same start and gradient."""
    compiled = torch.compile(_mixed_adamw, dynamic=False)
    out = {}
    reference = _State(numel)
    _variants(reference, compiled)["fused"]()
    for name in ("compiled", "compiled+out"):
        state = _State(numel)
        _variants(state, compiled)[name]()
        out[name] = (state.param - reference.param).abs().max().item()
    return out


def measure(numel: int, threads: int, repeats: int, with_copies: bool) -> dict[str, float]:
    """Best seconds of each variant (and, with ``with_copies``, each with its copies) at ``threads`` threads."""
    torch.set_num_threads(threads)
    state = _State(numel, pinned=with_copies)
    runs = _variants(state, torch.compile(_mixed_adamw, dynamic=False))
    if with_copies:
        runs.update(_with_copies(state, runs))
    return _best(runs, repeats)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_host_step", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=2e7)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--with-copies", action="store_true", help="also each kernel beside its copies (needs a GPU)")
    args = p.parse_args(argv)
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("no C++ compiler here: inductor's CPU code generation needs one")
        return
    if args.with_copies and not torch.cuda.is_available():
        p.error("--with-copies needs a GPU (the copies run between it and pinned host memory)")
    numel = int(args.numel)
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    print(f"{where}; {numel:.3g} elements; best of {args.repeats}; compiler {compiler}; max |difference| from fused "
          f"after one step: " + ", ".join(f"{name} {value:.2e}" for name, value in difference().items()))
    print("| threads | run | bytes per element (kernel + in + out) | ms | of fused's | G elements/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        best = measure(numel, threads, args.repeats, args.with_copies)
        for name, seconds in best.items():
            kernel, into, out = BYTES[name.removesuffix(" with copies")]
            base = best["fused with copies" if name.endswith("with copies") else "fused"]
            print(f"| {threads} | {name} | {kernel} + {into} + {out} = {kernel + into + out} | {seconds * 1e3:.1f} | "
                  f"{seconds / base:.2f} | {numel / seconds / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
