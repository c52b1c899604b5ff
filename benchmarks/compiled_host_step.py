"""Would a code-generated host step cut the offloaded step's memory traffic? (issue 38)

The offloaded step moves, per element of host memory: 28 bytes in torch's fused CPU AdamW (fp32 parameter and
both moments read and written, the fp32 gradient read), 4 for the gradient's copy in from the GPU (fp32, cast on
the GPU, since the kernel takes one dtype) and 4 for the write-back's copy out (fp32, cast on the GPU): 36. The
kernel is bound by the host's memory bandwidth (``python -m benchmarks.host_bandwidth``), so when the step runs
beside backward's gradient copies (``overlap_with_backward``) those bytes cost it time. A kernel that read bf16
gradients and wrote the bf16 parameter beside the fp32 master would move 28 + 2 + 2 = 32. torch has no such
kernel; ``torch.compile`` (inductor's CPU code generation, needs a C++ compiler) can make one. This times it
against torch's fused kernel on the same fp32 state:

    python -m benchmarks.compiled_host_step --numel 2e7 --threads 2 1

``fused``: ``torch._fused_adamw_`` with an fp32 gradient (the engine's host step); ``compiled``: AdamW written out
(torch's formula) and compiled, bf16 gradient in, fp32 master and moments updated in place, bf16 parameter out;
best of ``--repeats`` after warm-up, taking turns. Not bit for bit torch's kernel (another order of operations):
the max difference from ``fused`` after one step is printed.
"""

from __future__ import annotations

import argparse
import shutil

import torch

from benchmarks.gpu_host_step import _best  # the fastest of repeated calls, the variants taking turns

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-4, 0.9, 0.999, 1e-8, 0.01


def _mixed_adamw(param, avg, sq, grad16, out16, step_size, bias2_sqrt) -> None:
    """One AdamW step (torch's formula) on fp32 state with a bf16 gradient, the bf16 parameter written too."""
    grad = grad16.float()
    new_avg = avg * BETA1 + grad * (1 - BETA1)
    new_sq = sq * BETA2 + grad * grad * (1 - BETA2)
    new_param = param * (1 - LR * WEIGHT_DECAY) - step_size * new_avg / (new_sq.sqrt() / bias2_sqrt + EPS)
    avg.copy_(new_avg)
    sq.copy_(new_sq)
    param.copy_(new_param)
    out16.copy_(new_param)


def measure(numel: int, threads: int, repeats: int) -> tuple[float, float, float]:
    """(fused seconds, compiled seconds, max |difference| of the parameters after one step of each)."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-3).bfloat16()
    fused = [start.clone(), torch.zeros(numel), torch.zeros(numel)]
    mixed = [start.clone(), torch.zeros(numel), torch.zeros(numel)]
    grad32, out16, step = grad.float(), torch.empty(numel, dtype=torch.bfloat16), torch.zeros(())
    count = [0]
    compiled = torch.compile(_mixed_adamw, dynamic=False)

    def run_fused() -> None:
        step.add_(1)  # as Adam.step does before its kernel
        torch._fused_adamw_([fused[0]], [grad32], [fused[1]], [fused[2]], [], [step], amsgrad=False, lr=LR,
                            beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY, eps=EPS, maximize=False,
                            grad_scale=None, found_inf=None)

    def run_compiled() -> None:
        count[0] += 1
        step_size = torch.tensor(LR / (1 - BETA1 ** count[0]))  # tensors: one compiled kernel for every step
        bias2_sqrt = torch.tensor((1 - BETA2 ** count[0]) ** 0.5)
        compiled(mixed[0], mixed[1], mixed[2], grad, out16, step_size, bias2_sqrt)

    run_fused()
    run_compiled()
    difference = (fused[0] - mixed[0]).abs().max().item()
    best = _best({"fused": run_fused, "compiled": run_compiled}, repeats)
    return best["fused"], best["compiled"], difference


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compiled_host_step", description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=float, default=2e7)
    p.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        print("no C++ compiler here: inductor's CPU code generation needs one")
        return
    numel = int(args.numel)
    print(f"{numel:.3g} elements; best of {args.repeats}; compiler {compiler}")
    print("| threads | fused (ms, 28+4+4 B/element moved) | compiled (ms, 28+2+2) | compiled / fused "
          "| max difference |")
    print("| --- | --- | --- | --- | --- |")
    for threads in args.threads:
        fused, compiled, difference = measure(numel, threads, args.repeats)
        print(f"| {threads} | {fused * 1e3:.1f} | {compiled * 1e3:.1f} | {compiled / fused:.2f} | {difference:.2e} |",
              flush=True)


if __name__ == "__main__":
    main()
