"""The text of docs/benchmarks.md: how to run, the machine, the tables, the plots and the targets.

Everything here is generated from one run's results; the hand-written explanations of the targets live in
benchmarks/analysis.md and are copied in verbatim, so rewriting the docs never loses them.
"""

from __future__ import annotations

from pathlib import Path

from .report import OURS, Row

ANALYSIS = Path(__file__).with_name("analysis.md")

HOW_TO_RUN = """\
```bash
pip install -e ".[bench]"            # matplotlib for the plots; torch, lightning, ... from the project
python -m benchmarks.run --world-size 2 --steps 20 --repeats 3
# optional: DeepSpeed in its own environment that reuses the installed torch (never a project dependency)
python3 -m venv --system-site-packages /tmp/ds-venv
/tmp/ds-venv/bin/pip install wheel setuptools
DS_BUILD_OPS=0 /tmp/ds-venv/bin/pip install --no-build-isolation deepspeed==0.19.8
python -m benchmarks.run --world-size 2 --deepspeed-python /tmp/ds-venv/bin/python
python -m benchmarks.run --report-only   # rewrite this page from benchmarks/results/latest.json
```
Useful flags: `--world-size 2 4`, `--impls ddp zero2 ...`, model shape (`--d-model --n-layer --vocab --seq-len
--batch-size`), `--bucket-numel`, `--no-overlap-comm`, `--fsdp-no-reshard`, `--zero-config '{"reduce_scatter": false}'`.
DeepSpeed's first run compiles a small CPU op (about 1.5 minutes)."""

COLUMNS = """\
- **step (s)**: median over the timed steps on rank 0 in each repeat, then the fastest repeat (other jobs only
  ever slow a run down); **× DDP** divides by DDP's at the same N. Forward, backward and optimizer step (with its parameter all-gather) are all inside. **CPU
  s/step**: the median over ranks and steps of the process CPU time (user + system, every thread of the rank:
  compute and gloo's), a second measure that other jobs on the machine disturb much less than wall time.
- **loss after K**: the training loss of the last step (K = warm-up + timed steps), averaged over ranks; **max
  Δloss** is the largest difference from DDP's loss over all K steps.
- **model states B/Ψ**: bytes per rank of parameters + gradients + fp32 master + optimizer state, each storage
  counted once, on the rank holding the most, measured on the last step between backward and the optimizer step
  (when all of them exist), divided by Ψ; in parentheses the paper's formula for fp32 AdamW (16, 4+4+8/N, 4+12/N,
  16/N for stages 0-3). **buffers** are module buffers and bucket scratch, outside the formula. **estimator** is
  `zero_core.tools.estimator`'s prediction for our engine.
- **peak RSS**: the largest rank's peak resident memory (`getrusage`), and in parentheses its growth from just
  before the model was wrapped (torch's import and the model's first copy come before).
- **comm/step ÷ Ψ**: elements per timed step counted at the `ProcessGroup` methods (outermost call only; DDP's
  all-reduce through a counting comm hook), the paper's unit: reduce-scatter input, all-gather output, broadcast
  tensor, all-reduce tensor **counted twice** (a reduce-scatter plus an all-gather). Paper: 2 for DDP and stages
  1-2, 3 for stage 3. **engine counter** is the same sum from our engine's own `comm_stats()`, a cross-check."""


def _machine(results: dict) -> str:
    m = results["machine"]
    lines = [f"- {m['cpus']} CPU cores ({m['cpu']}), {m['platform']}", f"- Python {m['python']}, torch {m['torch']}"]
    if "deepspeed" in m:
        lines.append(f"- DeepSpeed {m['deepspeed']} (separate environment, `DS_ACCELERATOR=cpu`, gloo)")
    lines.append(f"- lightning-zero at commit {m.get('commit', 'unknown')}")
    lines.append(f"- run on {m['date']}; the cores are shared with other jobs, so step times are noisy")
    return "\n".join(lines)


def _settings(results: dict, rows: list[Row]) -> str:
    spec = next(iter(results["specs"].values()))
    model, numel = spec["model"], next((r.numel for r in rows if r.status == "ok"), 0)
    return (f"GPT-style model (benchmarks/gpt.py): vocab {model['vocab']}, d_model {model['d_model']}, "
            f"{model['n_layer']} layers, {model['n_head']} heads, sequence {model['seq_len']}, batch "
            f"{model['batch_size']} per rank, tied LM head: **Ψ = {numel:,}** trainable parameters. fp32, AdamW "
            f"(lr {spec['lr']}, weight decay {spec['weight_decay']}), same seed and data on every implementation. "
            f"{spec['warmup']} warm-up + {spec['steps']} timed steps, {results['args']['repeats']} interleaved repeats, "
            f"buckets of {spec['bucket_numel']:,} elements (DDP's 25 MiB), overlap_comm="
            f"{spec['overlap_comm']}, FSDP2 reshard_after_forward={spec['fsdp_reshard_after_forward']}, "
            f"{spec['threads']} torch thread(s) per rank.")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _comm_verdict(measured: float, paper: float) -> str:
    if abs(measured / paper - 1) <= 0.01:
        return "met"
    return "**below the paper's volume**, not within 1%" if measured < paper else "**missed**"


def _time_line(n: int, r: Row) -> str:
    return (f"- N={n}, {r.label}: step time {r.ratio:.2f}× DDP (wall, fastest repeat), {r.cpu_ratio:.2f}× in CPU "
            f"time; target ≤ 1.05: wall {_verdict(r.ratio <= 1.05)}, CPU {_verdict(r.cpu_ratio <= 1.05)}")


def targets(rows: list[Row]) -> str:
    lines = []
    for n in sorted({r.world_size for r in rows}):
        at_n = {r.impl: r for r in rows if r.world_size == n and r.status == "ok"}
        ours = [at_n[i] for i in OURS if i in at_n]
        for r in ours:
            mem_ok = r.states_per_param <= r.formula * 1.02
            lines.append(f"- N={n}, {r.label}: communication {r.comm_per_param:.3f}Ψ vs {r.paper_comm:g}Ψ "
                         f"({_comm_verdict(r.comm_per_param, r.paper_comm)}); model states {r.states_per_param:.2f} "
                         f"vs {r.formula:.2f} B/Ψ × 1.02 ({_verdict(mem_ok)})")
        lines += [_time_line(n, r) for r in ours if r.stage in (1, 2) and r.ratio is not None]
        if "zero3" in at_n and "fsdp2" in at_n:
            r, f = at_n["zero3"], at_n["fsdp2"]
            lines.append(f"- N={n}, stage 3: {r.step_s:.3f} s vs FSDP2 {f.step_s:.3f} s wall ("
                         f"{_verdict(r.step_s <= f.step_s)}), {r.cpu_s:.3f} vs {f.cpu_s:.3f} CPU s/step "
                         f"({_verdict(r.cpu_s <= f.cpu_s)}); target ≤ FSDP2")
        missing = [i for i in OURS if i not in at_n]
        if missing:
            lines.append(f"- N={n}: no result for {', '.join(missing)} (see the table), so its targets are open")
    return "\n".join(lines)


def render(results: dict, rows: list[Row], images: dict, main: str, memory: str, comm: str) -> str:
    analysis = ANALYSIS.read_text().strip() if ANALYSIS.exists() else "(benchmarks/analysis.md is missing)"
    parts = [
        "# Benchmarks: lightning-zero against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed",
        "This page is written by `python -m benchmarks.run`; do not edit it by hand (the analysis section comes "
        "from benchmarks/analysis.md).",
        "## How to run", HOW_TO_RUN,
        "## This run", f"Command: `{results['command']}`", _machine(results), _settings(results, rows),
        "## Results", main, COLUMNS,
        "### Model states by class (bytes per rank ÷ Ψ)", memory,
        "### Collectives per step (calls, elements ÷ Ψ, as counted at the ProcessGroup)", comm,
        "## Plots",
        f"![model-state memory per rank against world size]({images['memory']})",
        f"![communication volume per step]({images['comm']})",
        f"![step time relative to DDP]({images['time']})",
        "## Targets (issue 7), checked on this run", targets(rows),
        "## Analysis", analysis,
    ]
    return "\n\n".join(parts) + "\n"
