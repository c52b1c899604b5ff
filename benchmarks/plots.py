"""The three PNG figures of docs/benchmarks.md (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from .implementations import LABELS, STAGE_OF

WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)
STAGE_NAMES = {0: "DDP (stage 0)", 1: "stage 1", 2: "stage 2", 3: "stage 3"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def make_plots(rows, results: dict, out: Path) -> dict[str, str]:
    """Write the figures under ``out``; returns {figure name: path relative to docs/}."""
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in rows if r.status == "ok"]
    figures = {"memory": _memory(ok, results, out / "bench-memory-vs-world-size.png"),
               "comm": _comm(ok, out / "bench-comm-per-step.png"),
               "time": _time(ok, out / "bench-step-time-ratio.png")}
    return {name: f"img/{path.name}" for name, path in figures.items()}


def _memory(rows, results: dict, path: Path) -> Path:
    """Estimator curves of model-state MiB per rank for the benchmark model, with the measured points."""
    import torch

    from zero_core.tools.estimator import estimate_memory, model_info

    from .gpt import GPTConfig, build_gpt

    spec = next(iter(results["specs"].values()))
    with torch.device("meta"):
        info = model_info(build_gpt(GPTConfig(**spec["model"])))
    config = {"reduce_bucket_size": spec["bucket_numel"], "allgather_bucket_size": spec["bucket_numel"]}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage in (0, 1, 2, 3):
        values = [estimate_memory(info, config, n, stages=[stage])[0].model_states / 2**20 for n in WORLD_SIZES]
        ax.plot(WORLD_SIZES, values, marker=".", label=f"estimate, {STAGE_NAMES[stage]}")
    markers = {"ddp": "s", "torch_zero": "v", "fsdp2": "D", "zero1": "o", "zero2": "o", "zero3": "o",
               "deepspeed1": "x", "deepspeed2": "x", "deepspeed3": "x"}
    for impl in sorted({r.impl for r in rows}, key=list(LABELS).index):
        points = [(r.world_size, r.states_per_param * r.numel / 2**20) for r in rows if r.impl == impl]
        ax.scatter(*zip(*points), marker=markers.get(impl, "+"), s=45, zorder=3,
                   color=f"C{STAGE_OF[impl]}", label=f"measured, {LABELS[impl]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(WORLD_SIZES, [str(n) for n in WORLD_SIZES])
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("model-state MiB per rank (fp32 AdamW)")
    ax.set_title(f"Model states per rank, Ψ = {info.trainable_numel / 1e6:.1f}M")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _bars(ax, rows, value, ylabel: str) -> None:
    world_sizes = sorted({r.world_size for r in rows})
    impls = sorted({r.impl for r in rows}, key=list(LABELS).index)
    width = 0.8 / max(len(world_sizes), 1)
    for i, n in enumerate(world_sizes):
        heights = [next((value(r) for r in rows if r.impl == impl and r.world_size == n), 0) for impl in impls]
        ax.bar([x + i * width for x in range(len(impls))], heights, width, label=f"N = {n}")
    ax.set_xticks([x + width * (len(world_sizes) - 1) / 2 for x in range(len(impls))],
                  [_short(i) for i in impls],
                  rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)


def _comm(rows, path: Path) -> Path:
    """Stacked by collective (all-reduce weighted 2, as in the paper), at the smallest world size run."""
    from .counting import PAPER_WEIGHT, kinds

    plt = _pyplot()
    n = min(r.world_size for r in rows)
    rows = sorted([r for r in rows if r.world_size == n], key=lambda r: list(LABELS).index(r.impl))
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(rows)
    for kind in [k for k in kinds([r.comm for r in rows]) if k != "barrier"]:
        heights = [PAPER_WEIGHT.get(kind, 1) * r.comm.get(kind, {"elements": 0})["elements"] / r.numel for r in rows]
        label = f"{kind} (× 2)" if PAPER_WEIGHT.get(kind, 1) == 2 else kind
        ax.bar(range(len(rows)), heights, 0.6, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.scatter(range(len(rows)), [r.paper_comm for r in rows], marker="_", s=900, color="black", zorder=3,
               label="paper (2 for DDP and stages 1-2, 3 for stage 3)")
    ax.set_xticks(range(len(rows)), [_short(r.impl) for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("elements per step ÷ Ψ")
    ax.set_ylim(0, max(bottoms + [3.0]) * 1.35)
    ax.set_title(f"Communication volume per step (N = {n}, counted at the ProcessGroup)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _short(impl: str) -> str:
    return LABELS[impl].replace("lightning-zero", "ours").replace(" + DDP", "")


def _time(rows, path: Path) -> Path:
    """Wall time (fastest repeat) and CPU time per step, each divided by DDP's at the same world size."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    timed = [r for r in rows if r.ratio is not None]
    panels = ((lambda r: r.ratio, "wall time ÷ DDP's (fastest repeat)"), (lambda r: r.cpu_ratio, "CPU time ÷ DDP's"))
    for ax, (value, title) in zip(axes, panels):
        _bars(ax, timed, value, title)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.axhline(1.05, color="gray", linestyle="--", linewidth=0.8)
        ax.text(-0.4, 1.07, "target for stages 1-2: 1.05", fontsize=7, color="gray")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("Step time relative to DDP (same world size; N = 4 runs 4 ranks on 2 cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
