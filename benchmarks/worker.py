"""One rank of one implementation: ``python -m benchmarks.worker --spec spec.json --impl zero2 --out rank0.json``.

Launched by benchmarks/run.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (one fresh process per
rank and run, so peak RSS belongs to one implementation). Trains ``warmup + steps`` steps and writes one JSON
result: step times, losses, model-state bytes, RSS, and collectives counted over the timed steps only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .counting import CommCounter
from .gpt import GPTConfig, batch, build_gpt, num_params
from .measure import rss_bytes


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs besides its rank; written once by the runner as JSON."""

    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 20
    warmup: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.01
    bucket_numel: int = 6_553_600  # 25 MiB of fp32, DDP's default bucket
    overlap_comm: bool = True
    fsdp_reshard_after_forward: bool = True
    zero_config: dict = field(default_factory=dict)
    threads: int = 1
    timeout_s: float = 900.0
    compile: str = ""  # a torch.compile backend ("inductor", "aot_eager"), or "" for eager
    compile_mode: str = "whole"  # "whole": torch.compile(model); "block": block.compile() per block (torchtitan)

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        return cls(**{**data, "model": GPTConfig(**data["model"])})

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def train(impl: str, spec: RunSpec, rank: int, counter: CommCounter) -> dict:
    from .implementations import IMPLEMENTATIONS, set_compile

    set_compile(spec.compile, spec.compile_mode)
    model = build_gpt(spec.model)
    if spec.compile and spec.compile_mode == "block":  # before the implementation wraps it, as torchtitan does
        for block in model.blocks:
            block.compile(backend=spec.compile)
    numel = num_params(model)
    rss_start, _ = rss_bytes()
    trained = IMPLEMENTATIONS[impl](model, spec)
    dist.barrier()
    losses, times, cpu_times, total = [], [], [], spec.warmup + spec.steps
    frames_at_warmup = 0
    for step in range(total):
        if step == spec.warmup:
            _start_counting(counter, trained.engine)
            frames_at_warmup = _compiled_frames()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = trained.forward_backward(batch(spec.model, rank, step))
        if step == total - 1:  # model states at their peak; not timed, and no collective runs here
            pause, cpu_pause = time.perf_counter(), time.process_time()
            memory = trained.memory()
            start += time.perf_counter() - pause
            cpu_start += time.process_time() - cpu_pause
        trained.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)  # every thread of this rank: compute and gloo's
    counter.enabled = False
    result = {"compile": _compile_stats(spec, frames_at_warmup)} if spec.compile else {}
    result.update({"numel": numel, "losses": losses, "times": times[spec.warmup:], "cpu_times": cpu_times[spec.warmup:],
              "comm": counter.stats(), "memory": memory})
    if trained.engine is not None:
        result["engine_comm"] = trained.engine.comm_stats()
    rss_end, rss_peak = rss_bytes()
    result.update(rss_start=rss_start, rss_end=rss_end, rss_peak=rss_peak)
    return result


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _compile_stats(spec: RunSpec, frames_at_warmup: int) -> dict:
    """Graph breaks and graphs over the whole run; frames dynamo gave up on (they run eagerly: a break inside a
    loop skips the whole frame, which dynamo does not count as a graph break); frames compiled during the timed
    steps (recompilations)."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {"backend": spec.compile, "mode": spec.compile_mode, "graph_breaks": sum(counters["graph_break"].values()),
            "frames_skipped": frames["total"] - frames["ok"], "graphs": counters["stats"]["unique_graphs"],
            "timed_recompiles": _compiled_frames() - frames_at_warmup}


def _start_counting(counter: CommCounter, engine) -> None:
    counter.reset()
    counter.enabled = True
    if engine is not None:
        engine.reset_comm_stats()


def run(impl: str, spec: RunSpec) -> dict:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec.threads)
    counter = CommCounter().install()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=spec.timeout_s))
    try:
        result = train(impl, spec, rank, counter)
        result["status"] = "ok"
    except NotImplementedError as err:
        result = {"status": "unavailable", "reason": str(err)}
    finally:
        counter.uninstall()
    result.update(impl=impl, rank=rank, world_size=world_size, torch=torch.__version__)
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="path of the RunSpec JSON written by benchmarks.run")
    parser.add_argument("--impl", required=True)
    parser.add_argument("--out", required=True, help="where to write this rank's JSON result")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = RunSpec.from_json(f.read())
    try:
        result = run(args.impl, spec)
    except Exception:
        result = {"status": "error", "impl": args.impl, "rank": int(os.environ.get("RANK", -1)),
                  "reason": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
