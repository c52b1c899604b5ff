"""Turn the raw runs of benchmarks/run.py into one row per (world size, implementation), and into docs.

Step time: the median over timed steps on rank 0 in each repeat, then the fastest repeat (other jobs on a shared
machine only ever slow a run down, so the least disturbed repeat is the best estimate); CPU time per step is the
median over repeats, ranks and steps. Memory and communication are
deterministic (checked equal over repeats by the loss curves); they are read from the first good repeat,
memory as the largest rank, communication on rank 0 (every rank issues the same collectives).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from zero_core.tools.estimator import paper_bytes_per_param

from .counting import engine_volume, kinds, paper_volume
from .implementations import LABELS, STAGE_OF
from .measure import MODEL_STATE_CLASSES

PAPER_COMM = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
OURS = ("zero1", "zero2", "zero3")


@dataclass
class Row:
    impl: str
    world_size: int
    status: str
    reason: str = ""
    numel: int = 0
    step_s: Optional[float] = None
    step_s_runs: list = field(default_factory=list)
    ratio: Optional[float] = None
    cpu_s: Optional[float] = None
    cpu_ratio: Optional[float] = None
    losses: list = field(default_factory=list)
    loss_diff: Optional[float] = None
    repeat_diff: float = 0.0
    memory: dict = field(default_factory=dict)
    states_per_param: Optional[float] = None
    buffers_per_param: Optional[float] = None
    rss_peak_mb: Optional[float] = None
    rss_growth_mb: Optional[float] = None
    comm: dict = field(default_factory=dict)
    comm_per_param: Optional[float] = None
    engine_comm_per_param: Optional[float] = None
    estimate_per_param: Optional[float] = None

    @property
    def label(self) -> str:
        return LABELS.get(self.impl, self.impl)

    @property
    def stage(self) -> int:
        return STAGE_OF[self.impl]

    @property
    def formula(self) -> float:
        return paper_bytes_per_param(self.stage, self.world_size, "fp32")

    @property
    def paper_comm(self) -> float:
        return PAPER_COMM[self.stage]


def _mean_curve(ranks: list[dict]) -> list[float]:
    curves = [r["losses"] for r in ranks]
    return [sum(values) / len(values) for values in zip(*curves)]


def _row(impl: str, world_size: int, runs: list[dict], spec: dict) -> Row:
    good = [run["ranks"] for run in runs if all(r.get("status") == "ok" for r in run["ranks"])]
    if not good:
        ranks = runs[0]["ranks"] if runs else []
        bad = next((r for r in ranks if r.get("status") != "ok"), {"status": "error", "reason": "no run"})
        return Row(impl, world_size, bad.get("status", "error"), bad.get("reason", ""))
    first = good[0]
    numel, steps = first[0]["numel"], len(first[0]["times"])
    curves = [_mean_curve(ranks) for ranks in good]
    row = Row(impl, world_size, "ok", numel=numel, losses=curves[0])
    row.repeat_diff = max(abs(a - b) for curve in curves for a, b in zip(curve, curves[0]))
    row.step_s_runs = [statistics.median(ranks[0]["times"]) for ranks in good]
    row.step_s = min(row.step_s_runs)
    row.cpu_s = statistics.median(statistics.median(r["cpu_times"]) for ranks in good for r in ranks)
    row.memory = max((r["memory"] for r in first), key=lambda m: sum(m.get(c, 0) for c in MODEL_STATE_CLASSES))
    row.states_per_param = sum(row.memory.get(c, 0) for c in MODEL_STATE_CLASSES) / numel
    row.buffers_per_param = row.memory.get("buffers", 0) / numel
    row.rss_peak_mb = statistics.median(max(r["rss_peak"] for r in ranks) for ranks in good) / 2**20
    row.rss_growth_mb = statistics.median(max(r["rss_peak"] - r["rss_start"] for r in ranks) for ranks in good) / 2**20
    row.comm = {k: {"calls": v["calls"] / steps, "elements": v["elements"] / steps} for k, v in first[0]["comm"].items()}
    row.comm_per_param = paper_volume(first[0]["comm"]) / steps / numel
    if "engine_comm" in first[0]:
        row.engine_comm_per_param = engine_volume(first[0]["engine_comm"]) / steps / numel
    if impl in OURS:
        row.estimate_per_param = _estimate(impl, world_size, spec)
    return row


def _estimate(impl: str, world_size: int, spec: dict) -> float:
    from zero_core.tools.estimator import estimate_stage, model_info

    from .gpt import GPTConfig, build_gpt

    import torch

    with torch.device("meta"):
        model = build_gpt(GPTConfig(**spec["model"]))
    config = {"stage": STAGE_OF[impl], "reduce_bucket_size": spec["bucket_numel"],
              "allgather_bucket_size": spec["bucket_numel"], **spec.get("zero_config", {})}
    return estimate_stage(model_info(model), config, world_size).per_param()


def summarize(results: dict) -> list[Row]:
    rows = []
    for world_size in sorted({run["world_size"] for run in results["runs"]}):
        spec = results["specs"][str(world_size)]
        for impl in results["impls"]:
            runs = [r for r in results["runs"] if r["impl"] == impl and r["world_size"] == world_size]
            rows.append(_row(impl, world_size, runs, spec))
        _compare_with_ddp([r for r in rows if r.world_size == world_size])
    return rows


def _compare_with_ddp(rows: list[Row]) -> None:
    ddp = next((r for r in rows if r.impl == "ddp" and r.status == "ok"), None)
    if ddp is None:
        return
    for row in rows:
        if row.status == "ok":
            row.ratio = row.step_s / ddp.step_s
            row.cpu_ratio = row.cpu_s / ddp.cpu_s
            row.loss_diff = max(abs(a - b) for a, b in zip(row.losses, ddp.losses))


# -- text ------------------------------------------------------------------------------------------------------

def _f(value: Optional[float], fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def table(rows: list[Row]) -> str:
    head = ["implementation", "N", "step (s)", "× DDP", "CPU s/step", "× DDP", "loss after K", "max Δloss vs DDP",
            "model states B/Ψ (paper)", "estimator B/Ψ", "buffers B/Ψ", "peak RSS MiB (growth)",
            "comm/step ÷ Ψ (paper)", "engine counter ÷ Ψ"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if r.status != "ok":
            status = "not available yet" if r.status == "unavailable" else f"failed: {_first_line(r.reason)}"
            lines.append(f"| {r.label} | {r.world_size} | {status} |" + " |" * (len(head) - 3))
            continue
        cells = [r.label, str(r.world_size), _f(r.step_s, ".3f"), _f(r.ratio, ".2f"), _f(r.cpu_s, ".3f"),
                 _f(r.cpu_ratio, ".2f"), _f(r.losses[-1], ".5f"),
                 _f(r.loss_diff, ".1e"), f"{r.states_per_param:.2f} ({r.formula:.2f})",
                 _f(r.estimate_per_param, ".2f"), _f(r.buffers_per_param, ".2f"),
                 f"{r.rss_peak_mb:.0f} (+{r.rss_growth_mb:.0f})", f"{r.comm_per_param:.3f} ({r.paper_comm:g})",
                 _f(r.engine_comm_per_param, ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "unknown")[:160].replace("|", "/")


def memory_table(rows: list[Row]) -> str:
    classes = ("params", "grads", "fp32_master", "optimizer_state", "buffers")
    lines = ["| implementation | N | " + " | ".join(f"{c} B/Ψ" for c in classes) + " |", "|" + " --- |" * (len(classes) + 2)]
    for r in rows:
        if r.status == "ok":
            cells = [f"{r.memory.get(c, 0) / r.numel:.3f}" for c in classes]
            lines.append(f"| {r.label} | {r.world_size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comm_table(rows: list[Row]) -> str:
    names = kinds([r.comm for r in rows if r.status == "ok"])
    lines = ["| implementation | N | " + " | ".join(f"{k} calls, ÷Ψ" for k in names) + " |",
             "|" + " --- |" * (len(names) + 2)]
    for r in rows:
        if r.status == "ok":
            cells = [f"{r.comm[k]['calls']:g}, {r.comm[k]['elements'] / r.numel:.3f}" if k in r.comm else "–"
                     for k in names]
            lines.append(f"| {r.label} | {r.world_size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_console(rows: list[Row]) -> str:
    return table(rows) + "\n\n" + memory_table(rows) + "\n\n" + comm_table(rows)


def write_docs(results: dict, rows: list[Row], docs: Path) -> Path:
    from .docs import render
    from .plots import make_plots

    images = make_plots(rows, results, docs / "img")
    path = docs / "benchmarks.md"
    path.write_text(render(results, rows, images, table(rows), memory_table(rows), comm_table(rows)))
    return path
