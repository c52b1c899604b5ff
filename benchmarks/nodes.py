"""Across nodes: bytes per link class and step time for DDP, stage 3, hpZ, ZeRO++ and MiCS (docs/multinode.md).

    python -m benchmarks.nodes --steps 200           # 2 simulated nodes x 2 ranks, gloo on localhost
    python -m benchmarks.nodes --steps 200 --seeds 3 --variants zero3 "zero3 (control: other init)" zero3+qgZ ...

One set of 4 CPU processes gets a 2-node launcher environment (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) and
trains every variant in turn on the harness GPT (benchmarks/gpt.py, shrunk by default so 200 steps stay short),
same seed and data. Bytes are what the comm layer counted (zero_core/comm/communicator.py, link classes); DDP does not go
through it, so its row is the same accounting computed for its all-reduce (2Ψ/N to each peer). Stage 3
variants gather every unit in the forward and again in the backward (no persistent or reused units), as a
large model does. Results go to benchmarks/results/nodes.json and the table in docs/multinode.md.

With ``--seeds K`` every variant trains K times, seeds 0..K-1 (each seed draws both the initial weights and the
data), and each run's final loss is compared with stage 3's at the same seed: the table gives the mean, the
standard deviation and the range of that relative loss over the seeds (results/nodes_seeds.json, the second table
in docs/multinode.md). The control row is plain stage 3 on the same data from other initial weights (seed + 1000):
how far two unquantised runs on the same batches end apart, the noise floor a quantised variant is judged against.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .gpt import GPTConfig, batch, build_gpt, num_params

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "nodes.json"
DOC = ROOT / "docs" / "multinode.md"
BEGIN, END = "<!-- BEGIN GENERATED: python -m benchmarks.nodes -->\n", "<!-- END GENERATED -->"
SEEDED_BEGIN = "<!-- BEGIN GENERATED: python -m benchmarks.nodes --seeds -->\n"
CONTROL = "zero3 (control: other init)"
INIT_SHIFT = {CONTROL: 1000}  # the control starts from other weights; its data stay the seed's
NODES, PER_NODE = 2, 2

Z3 = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0, "bf16": {"enabled": True}}
VARIANTS = {
    "ddp": None,
    "zero3": Z3,
    "zero3+hpZ": {**Z3, "zero_hpz_partition_size": PER_NODE},
    "zero3+qwZ": {**Z3, "zero_quantized_weights": True},
    "zero3+qgZ": {**Z3, "zero_quantized_gradients": True},
    "zero3+qwZ+qgZ": {**Z3, "zero_quantized_weights": True, "zero_quantized_gradients": True},
    "ZeRO++ (qwZ+hpZ+qgZ)": {**Z3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                             "zero_hpz_partition_size": PER_NODE},
    "MiCS shard 2 (in-node)": {**Z3, "mics_shard_size": PER_NODE},
    "zero3 hierarchical gather": {**Z3, "mics_shard_size": NODES * PER_NODE, "mics_hierarchical_params_gather": True},
    CONTROL: Z3,
}
SMALL = GPTConfig(vocab=2048, d_model=128, n_layer=4, n_head=4, seq_len=32, batch_size=4)


def _train(rank: int, name: str, config, model_config: GPTConfig, steps: int, warmup: int) -> dict:
    import zero_core

    model = build_gpt(replace(model_config, seed=model_config.seed + INIT_SHIFT.get(name, 0)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = None
    if config is None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        engine = zero_core.setup(model, optimizer, config)
    losses, times = [], []
    for step in range(warmup + steps):
        if step == warmup and engine is not None:
            engine.reset_comm_stats()
            engine.comm.paths.codec_seconds = 0.0
        start = time.perf_counter()
        loss = model(*batch(model_config, rank, step))
        if engine is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"losses": losses, "step_s": statistics.median(times[warmup:])}
    if engine is not None:
        links = engine.link_bytes()
        result.update(cross=links["cross_node"] / steps, inside=links["in_node"] / steps,
                      codec_s=engine.comm.paths.codec_seconds / steps)
        engine.close()
    else:  # DDP's all-reduce of Ψ fp32 gradients, in the comm layer's accounting: 2Ψ/N bytes to each peer
        psi, world = num_params(model.module), NODES * PER_NODE
        per_peer = 2 * psi * 4 / world
        result.update(cross=per_peer * PER_NODE * (NODES - 1), inside=per_peer * (PER_NODE - 1), codec_s=0.0)
    return result


def _rank(rank: int, port: int, names: list, model_config: GPTConfig, steps: int, warmup: int, seeds: int,
          out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(NODES * PER_NODE), LOCAL_RANK=str(rank % PER_NODE),
                      LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(rank // PER_NODE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=NODES * PER_NODE, timeout=timedelta(minutes=30))
    results: dict = {name: [] for name in names}  # variant -> one run per seed
    for seed in range(seeds):
        for name in names:
            run = _train(rank, name, VARIANTS[name], replace(model_config, seed=seed), steps, warmup)
            results[name].append(run)
            if rank == 0:
                print(f"seed {seed} {name}: {run['step_s'] * 1e3:.0f} ms/step, loss {run['losses'][-1]:.4f}",
                      flush=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def summarize(per_rank: list, steps: int, psi: int) -> dict:
    """Per variant: means over ranks and seeds; the final loss relative to stage 3's at the same seed, per seed."""
    tail = max(1, min(10, steps // 10))
    seeds = len(next(iter(per_rank[0].values())))
    finals = {name: [statistics.mean(statistics.mean(r[name][s]["losses"][-tail:]) for r in per_rank)
                     for s in range(seeds)] for name in per_rank[0]}
    rows = {}
    for name in per_rank[0]:
        runs = [run for r in per_rank for run in r[name]]
        rows[name] = {
            "step_ms": 1e3 * statistics.mean(r["step_s"] for r in runs),
            "cross_bytes": statistics.mean(r["cross"] for r in runs),
            "in_node_bytes": statistics.mean(r["inside"] for r in runs),
            "codec_ms": 1e3 * statistics.mean(r["codec_s"] for r in runs),
            "final_loss": statistics.mean(finals[name]),
            "final_loss_per_seed": finals[name],
        }
    base = rows.get("zero3")
    for name, row in rows.items():
        row["cross_vs_zero3"] = row["cross_bytes"] / base["cross_bytes"] if base else None
        gaps = [mine / ref - 1 for mine, ref in zip(finals[name], finals["zero3"])] if base else None
        row["loss_vs_zero3_per_seed"] = gaps
        row["loss_vs_zero3"] = statistics.mean(gaps) if base else None
        row["loss_vs_zero3_std"] = statistics.stdev(gaps) if base and seeds > 1 else None
    return {"psi": psi, "steps": steps, "seeds": seeds, "rows": rows}


def table(summary: dict) -> str:
    lines = [f"Ψ = {summary['psi']:,} parameters, {summary['steps']} steps, 2 nodes × 2 ranks (gloo, localhost), "
             "bf16 for the ZeRO rows (DDP: fp32). Bytes are sent by one rank per step; loss is the mean of the "
             "last 10 steps over ranks.", "",
             "| variant | cross-node bytes/step | × stage 3 | in-node bytes/step | step (ms) | quantise CPU (ms/step) "
             "| final loss | vs stage 3 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in summary["rows"].items():
        ratio = "" if row["cross_vs_zero3"] is None else f"{row['cross_vs_zero3']:.3f}"
        gap = "" if row["loss_vs_zero3"] is None else f"{100 * row['loss_vs_zero3']:+.2f}%"
        lines.append(f"| {name} | {row['cross_bytes']:,.0f} | {ratio} | {row['in_node_bytes']:,.0f} | "
                     f"{row['step_ms']:.0f} | {row['codec_ms']:.1f} | {row['final_loss']:.4f} | {gap} |")
    return "\n".join(lines) + "\n"


def seeded_table(summary: dict) -> str:
    """The final loss relative to stage 3's at the same seed: mean, spread and every seed's value."""
    seeds = summary["seeds"]
    lines = [f"Ψ = {summary['psi']:,} parameters, {summary['steps']} steps, 2 nodes × 2 ranks (gloo, localhost), "
             f"bf16, seeds 0..{seeds - 1} (each draws the initial weights and the data). Per seed: the final loss "
             "(mean of the last 10 steps over ranks) relative to stage 3's at that seed; the control is stage 3 "
             "from other initial weights on the same data.", "",
             "| variant | × stage 3 cross-node bytes | mean vs stage 3 | std | min .. max | per seed |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, row in summary["rows"].items():
        gaps = row["loss_vs_zero3_per_seed"]
        if gaps is None:
            continue
        std = "" if row["loss_vs_zero3_std"] is None else f"{100 * row['loss_vs_zero3_std']:.2f}%"
        lines.append(f"| {name} | {row['cross_vs_zero3']:.3f} | {100 * row['loss_vs_zero3']:+.2f}% | {std} | "
                     f"{100 * min(gaps):+.2f}% .. {100 * max(gaps):+.2f}% | "
                     + ", ".join(f"{100 * g:+.2f}%" for g in gaps) + " |")
    return "\n".join(lines) + "\n"


def write_doc(summary: dict) -> None:
    """The single-seed table goes between the first markers, a seeded one (``--seeds`` > 1) between the second."""
    begin, text_of = (SEEDED_BEGIN, seeded_table) if summary["seeds"] > 1 else (BEGIN, table)
    text = DOC.read_text()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + begin + text_of(summary) + END + tail)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nodes", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != CONTROL],
                        choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, default=1,
                        help="train every variant with seeds 0..K-1 and report the spread of its loss vs stage 3")
    parser.add_argument("--full-gpt", action="store_true", help="the harness's default GPT instead of the small one")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite the table in docs/multinode.md")
    args = parser.parse_args()
    model_config = GPTConfig() if args.full_gpt else SMALL
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be at least 1, got {args.seeds}")
    if args.seeds > 1 and "zero3" not in args.variants:
        raise SystemExit("--seeds compares every variant with stage 3 at the same seed: add zero3 to --variants")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = RESULTS.with_suffix(".raw.json")
    mp.spawn(_rank, args=(port, args.variants, model_config, args.steps, args.warmup, args.seeds, str(out)),
             nprocs=NODES * PER_NODE, join=True)
    summary = summarize(json.loads(out.read_text()), args.steps, num_params(build_gpt(model_config)))
    out.unlink()
    (RESULTS.with_name("nodes_seeds.json") if args.seeds > 1 else RESULTS).write_text(json.dumps(summary, indent=1))
    print(table(summary))
    if args.seeds > 1:
        print(seeded_table(summary))
    if not args.no_doc:
        write_doc(summary)


if __name__ == "__main__":
    main()
