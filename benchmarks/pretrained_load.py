"""Loading a pretrained Hugging Face model at stage 3: peak memory per rank and load time (not a timed test).

    python benchmarks/pretrained_load.py [--layers 10] [--ranks 4 2] [--deepspeed-python PATH]

A 119M-parameter Llama (vocabulary 32000, hidden 768, 10 layers, untied head) is saved once with
``save_pretrained`` as fp32 safetensors shards (about 456 MiB in 5 files). Then, each in fresh processes:

- ``plain, 1 process``: ``from_pretrained`` without any engine. transformers 5 maps the files, so this reads
  nothing yet; ``plain, 1 process, weights read`` also touches every parameter once (the time to beat: the
  weights in memory, as ours are);
- ``plain, every rank``: the same on N ranks (every rank holds the whole model);
- ``zero_core.Init``: ``with zero_core.Init(config={"stage": 3}): from_pretrained(...)`` at N ranks (each rank
  reads its own slices into its shard);
- ``zero_core.Init rank0_reads``: rank 0 reads, broadcasts one tensor at a time;
- ``DeepSpeed HfDeepSpeedConfig``: DeepSpeed's own ZeRO-3 path, when ``--deepspeed-python`` names a Python with
  DeepSpeed and transformers installed (DeepSpeed is never a dependency of this project).

transformers' modelling code is imported before the baseline (every mode needs it). Each rank samples its resident memory (RSS: anonymous plus the mapped file pages it touched) and RssAnon every
5 ms while ``from_pretrained`` runs; the table gives the peak growth over the rank's baseline as a multiple of the
checkpoint's bytes (max over ranks) and the wall time of the slowest rank's ``from_pretrained``.
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
    if mode in ("zero", "zero_rank0"):
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
        if mode in ("zero", "zero_rank0"):
            with zero_core.Init(config={"stage": 3}, rank0_reads=mode == "zero_rank0"):
                model = AutoModelForCausalLM.from_pretrained(model_dir)
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
    parser.add_argument("--deepspeed-python", default=None, help="a Python with DeepSpeed and transformers")
    parser.add_argument("--out", default=str(WORKER.parent / "results" / "pretrained_load.md"))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        params = save_model(model_dir, args.layers)
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        files = len(list(model_dir.glob("*.safetensors")))
        rows = [("plain, 1 process", 1, launch(sys.executable, "plain", 1, model_dir)),
                ("plain, 1 process, weights read", 1, launch(sys.executable, "plain_read", 1, model_dir))]
        for ranks in args.ranks:
            rows.append(("zero_core.Init", ranks, launch(sys.executable, "zero", ranks, model_dir)))
            rows.append(("zero_core.Init rank0_reads", ranks, launch(sys.executable, "zero_rank0", ranks, model_dir)))
            rows.append(("plain, every rank", ranks, launch(sys.executable, "plain", ranks, model_dir)))
            if args.deepspeed_python:
                try:
                    rows.append(("DeepSpeed HfDeepSpeedConfig", ranks,
                                 launch(args.deepspeed_python, "deepspeed", ranks, model_dir)))
                except RuntimeError as error:  # another environment: report it, keep the other rows
                    print(error, file=sys.stderr)
                    rows.append(("DeepSpeed HfDeepSpeedConfig (failed, see stderr)", ranks, []))
    lines = [f"Llama, {params / 1e6:.0f}M parameters, fp32 safetensors in {files} files ({size / MB:.0f} MiB); "
             "peak growth per rank while from_pretrained runs, as a multiple of the checkpoint (max over ranks)",
             "", "| how | ranks | RSS growth | RssAnon growth | load time (slowest rank) |", "| --- | --- | --- | --- | --- |"]
    for name, ranks, results in rows:
        if not results:
            lines.append(f"| {name} | {ranks} | - | - | - |")
            continue
        growth = max(r["growth"] for r in results) / size
        anon = max(r["growth_anon"] for r in results) / size
        seconds = max(r["seconds"] for r in results)
        lines.append(f"| {name} | {ranks} | {growth:.2f}x | {anon:.2f}x | {seconds:.2f} s |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
