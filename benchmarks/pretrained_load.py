"""Loading a pretrained Hugging Face model at stage 3: peak memory per rank and load time (not a timed test).

    python benchmarks/pretrained_load.py [--layers 10] [--ranks 4 2] [--repeats 3] [--deepspeed-python PATH]

A 119M-parameter Llama (vocabulary 32000, hidden 768, 10 layers, untied head) is saved once with
``save_pretrained`` as fp32 safetensors shards (about 456 MiB in 5 files). Then, each in fresh processes:

- ``plain, 1 process``: ``from_pretrained`` without any engine. transformers 5 maps the files, so this reads
  nothing yet; ``plain, 1 process, weights read`` also touches every parameter once (the time to beat: the
  weights in memory, as ours are);
- ``plain, every rank``: the same on N ranks (every rank holds the whole model), also with every weight read;
- ``zero_core.Init``: ``with zero_core.Init(config={"stage": 3}): from_pretrained(...)`` at N ranks (each rank's
  shard of an fp32 tensor is a copy-on-write view of its slice of the file, so this reads nothing yet either);
  ``zero_core.Init, shards read`` also touches every element of the rank's shards once (the time to compare with
  ``plain, 1 process, weights read``: the rank's weights in memory);
- ``zero_core.Init rank0_reads``: rank 0 reads every rank's shards and scatters them, a bucket at a time;
- ``DeepSpeed HfDeepSpeedConfig``: DeepSpeed's own ZeRO-3 path, when ``--deepspeed-python`` names a Python with
  DeepSpeed and transformers installed (DeepSpeed is never a dependency of this project).

transformers' modelling code is imported before the baseline (every mode needs it). Each rank samples its resident memory (RSS: anonymous plus the mapped file pages it touched) and RssAnon every
5 ms while ``from_pretrained`` runs; the table gives the peak growth over the rank's baseline as a multiple of the
checkpoint's bytes (max over ranks and repeats) and the wall time of the slowest rank's ``from_pretrained`` (with
``--repeats``, the rows run in turn that many times, each in fresh processes: the median and the range).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1 << 20
WORKER = Path(__file__).resolve()


def memory() -> tuple[int, int]:
    """(RSS, RssAnon) in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                key, number = line.split()[:2]
                values[key] = int(number) * 1024
    return values["VmRSS:"], values["RssAnon:"]


class PeakSampler:
    def __init__(self, period_s: float = 0.005):
        self.period, self.peak, self.peak_anon = period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = memory()
            self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
            time.sleep(self.period)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        rss, anon = memory()
        self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)


def save_model(path: Path, layers: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = LlamaForCausalLM(config)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size="100MB")
    del shapes
    return sum(p.numel() for p in model.parameters())


def worker(mode: str, model_dir: str, out: str) -> None:
    """One rank: load the model the way ``mode`` says, write its measurements to ``out``/rank.json."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported before the baseline)

    zero_core = None

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    if mode.startswith("zero"):
        import zero_core  # imported before the baseline, as transformers is
    if mode == "deepspeed":
        import deepspeed  # noqa: F401  (the separate environment's)
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})  # noqa
    if distributed:
        dist.barrier()
    base_rss, base_anon = memory()
    start = time.perf_counter()
    with PeakSampler() as peak:
        if mode.startswith("zero"):
            with zero_core.Init(config={"stage": 3}, rank0_reads=mode == "zero_rank0") as init:
                model = AutoModelForCausalLM.from_pretrained(model_dir)
            if mode == "zero_read":  # a shard may be a view of the file: its values are read when first used
                for param in model.parameters():
                    init.shard_of(param).sum()
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            if mode == "plain_read":  # transformers maps the files: the values are read when first used
                with torch.no_grad():
                    for param in model.parameters():
                        param.sum()
    seconds = time.perf_counter() - start
    Path(out, f"{rank}.json").write_text(json.dumps({
        "rank": rank, "seconds": seconds, "growth": peak.peak - base_rss, "growth_anon": peak.peak_anon - base_anon,
        "params": sum(p.numel() for p in model.parameters())}))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(python: str, mode: str, ranks: int, model_dir: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = str(WORKER.parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
        if ranks == 1 and mode.startswith("plain"):
            cmd = [python, str(WORKER), "--worker", mode, str(model_dir), out]
        else:
            cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(_free_port()),
                   str(WORKER), "--worker", mode, str(model_dir), out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} at {ranks} ranks failed:\n{(done.stdout + done.stderr)[-4000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--repeats", type=int, default=1, help="run every row this many times, in turn")
    parser.add_argument("--deepspeed-python", default=None, help="a Python with DeepSpeed and transformers")
    parser.add_argument("--out", default=str(WORKER.parent / "results" / "pretrained_load.md"))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    configs = [("plain, 1 process", 1, "plain", sys.executable),
               ("plain, 1 process, weights read", 1, "plain_read", sys.executable)]
    for ranks in args.ranks:
        configs += [("zero_core.Init", ranks, "zero", sys.executable),
                    ("zero_core.Init, shards read", ranks, "zero_read", sys.executable),
                    ("zero_core.Init rank0_reads", ranks, "zero_rank0", sys.executable),
                    ("plain, every rank", ranks, "plain", sys.executable),
                    ("plain, every rank, weights read", ranks, "plain_read", sys.executable)]
        if args.deepspeed_python:
            configs.append(("DeepSpeed HfDeepSpeedConfig", ranks, "deepspeed", args.deepspeed_python))
    runs: dict[int, list[list[dict]]] = {i: [] for i in range(len(configs))}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        params = save_model(model_dir, args.layers)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        files = len(list(model_dir.glob("*.safetensors")))
        for _ in range(args.repeats):  # in turn, so that a busy moment of the machine spreads over every row
            for index, (name, ranks, mode, python) in enumerate(configs):
                try:
                    runs[index].append(launch(python, mode, ranks, model_dir))
                except RuntimeError as error:  # DeepSpeed's separate environment: report it, keep the other rows
                    if mode != "deepspeed":
                        raise
                    print(error, file=sys.stderr)
    lines = [f"Llama, {params / 1e6:.0f}M parameters, fp32 safetensors in {files} files ({size / MB:.0f} MiB); "
             "peak growth per rank while from_pretrained runs, as a multiple of the checkpoint (max over ranks"
             + (f" and {args.repeats} repeats" if args.repeats > 1 else "") + ")",
             "", "| how | ranks | RSS growth | RssAnon growth | load time (slowest rank) |",
             "| --- | --- | --- | --- | --- |"]
    for index, (name, ranks, _, _) in enumerate(configs):
        results = [r for r in runs[index] if r]
        if not results:
            lines.append(f"| {name} (failed, see stderr) | {ranks} | - | - | - |")
            continue
        growth = max(r["growth"] for run in results for r in run) / size
        anon = max(r["growth_anon"] for run in results for r in run) / size
        seconds = sorted(max(r["seconds"] for r in run) for run in results)
        spread = f" ({seconds[0]:.2f}-{seconds[-1]:.2f})" if len(seconds) > 1 else ""
        lines.append(f"| {name} | {ranks} | {growth:.2f}x | {anon:.2f}x | {seconds[len(seconds) // 2]:.2f} s{spread} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
