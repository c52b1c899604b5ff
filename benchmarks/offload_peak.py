"""Peak, not steady, host memory of ZeRO-Infinity at stage 3 (issue 38): how much of the offloaded bytes the
*peak* resident anonymous memory (RssAnon) of a training process gives back.

One rank (world size 1, gloo) trains a ``--layers`` x ``Linear(--width, --width)`` MLP (default 24 x 1024: 25.2M
parameters, fp32, AdamW; with ``--vocab V`` an ``Embedding(V, --width)`` in front, fed token ids: one piece far
bigger than the NVMe tile) for ``--steps`` steps in a fresh process per run, while a thread reads RssAnon from
``/proc/self/status`` every 5 ms and notes the phase the training thread is in (setup, forward, backward, step).
Runs:

- ``none``: stage 3 without offload;
- ``nvme``: ``offload_optimizer`` and ``offload_param`` on NVMe (``max_in_cpu: 0``: every parameter shard in the
  file), ``nvme_path`` a temporary directory under ``--dir``; other fields at their defaults unless given
  (``--sub-group-size``, ``--buffer-count``, ``--param-buffers``);
- ``nvme_whole`` (with ``--whole-pieces``): the same, a piece bigger than the tile stepped whole, as before
  pieces were stepped in slices (nvme_slices.py), and read whole by checkpoints, as before they streamed it in
  slices (piece_in_file.py);
- ``nvme_kept_grads`` (with ``--release-grads``): ``nvme``, with the reduced gradient shards kept until the step
  instead of written to the swap file during backward (nvme_grads.py), as before.

``--checkpoint``: after training each run saves a checkpoint (under ``--dir``) and loads it back, in phases
``save`` and ``load`` of their own.

``--release-grads`` gives gradient shards' memory back in every run as on CUDA (grad_memory.RELEASE_ON_CPU), where
this CPU run's host memory stands in for the accelerator's: the ``nvme`` run's shards then leave memory during
backward, and ``nvme_kept_grads`` shows what they held.

What offload can take away is the parameter shard, the fp32 master (in fp32 training the parameter shard itself,
counted once) and Adam's two moments: 12 bytes per parameter in fp32, 14 with ``--bf16`` (the engine's
``memory_stats`` of the run without offload). The table gives each run's peak during training (after setup), in
the step, between steps and over the whole process, and the drop of the offloaded run's peak as a fraction of
those bytes. glibc's allocator is left as users get it (no ``MALLOC_*`` variables) unless ``--mmap-threshold`` is
given. Results: benchmarks/results/offload_peak.md, docs/offload.md ("Peak host memory with NVMe").

    python -m benchmarks.offload_peak --dir /tmp --steps 5 --mmap-threshold 1048576 --out benchmarks/results/offload_peak.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1 << 20


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not in /proc/self/status (Linux only)")


class Sampler:
    """A thread that reads RssAnon every ``interval`` seconds and keeps the peak per phase (``phase`` is set by
    the training thread; the read is a few microseconds, the GIL is free while the step's kernels run)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._done.is_set():
            self.take()
            time.sleep(self.interval)

    def take(self) -> None:
        value, phase = rss_anon(), self.phase
        self.samples += 1
        if value > self.peaks.get(phase, 0):
            self.peaks[phase] = value

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.take()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zero_core

    torch.set_num_threads(args.threads)
    if args.release_grads:
        from zero_core import grad_memory

        grad_memory.RELEASE_ON_CPU = True  # as on CUDA: host memory stands in for the accelerator's
    if args.run == "nvme_kept_grads":
        from zero_core.offload.host_grads import HostGrads

        HostGrads._write_reduced = lambda self, *unused: None  # kept until the step, as before nvme_grads.py
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    baseline = rss_anon()
    config = {"stage": 3, "bf16": {"enabled": args.bf16}, **json.loads(args.zero)}
    if args.sub_group_size:
        config["sub_group_size"] = args.sub_group_size
    if args.run == "nvme_whole":
        from zero_core.offload import nvme_slices

        nvme_slices.sliced = lambda *unused: False
        from zero_core.offload.swapped_state import SwappedState

        SwappedState.in_slices = lambda *unused: False
    if args.run.startswith("nvme"):
        config["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path}
        config["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
        if args.buffer_count is not None:
            config["offload_optimizer"]["buffer_count"] = args.buffer_count
        if args.param_buffers is not None:
            config["offload_param"]["buffer_count"] = args.param_buffers
    with Sampler() as sampler:
        torch.manual_seed(0)
        head = [torch.nn.Embedding(args.vocab, args.width)] if args.vocab else []
        model = torch.nn.Sequential(*head, *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        numel = sum(p.numel() for p in model.parameters())
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        del model
        after_setup = rss_anon()
        x = (torch.randint(args.vocab, (args.batch,)) if args.vocab else
             torch.randn(args.batch, args.width, dtype=torch.bfloat16 if args.bf16 else torch.float32))
        steps, forward_backward = [], []  # seconds, from the second step on (the first creates Adam's state)
        for index in range(args.steps):
            start = time.perf_counter()
            sampler.phase = "forward"
            loss = engine.module(x).square().mean()
            sampler.phase = "backward"
            engine.backward(loss)
            middle = time.perf_counter()
            sampler.phase = "step"
            engine.step()
            sampler.phase = "between"
            if index:
                forward_backward.append(middle - start)
                steps.append(time.perf_counter() - middle)
        sampler.take()  # the last "between" sample, as the sampler's exit takes it without a checkpoint
        end = rss_anon()
        stats = engine.memory_stats()
        timings = {}
        if args.checkpoint:  # (after the training phases: the peaks above are training's alone)
            path = tempfile.mkdtemp(dir=os.path.dirname(args.nvme_path), prefix=f"checkpoint_{args.run}_")
            swapper = engine._offload.swapper if engine._offload is not None else None
            for phase, action in (("save", engine.save_checkpoint), ("load", engine.load_checkpoint)):
                sampler.phase = phase
                if swapper is not None:
                    swapper.peak_read_in_bytes = swapper.read_in_bytes
                start = time.perf_counter()
                action(path)
                timings[f"{phase}_s"] = time.perf_counter() - start
                if swapper is not None:  # what it held of the swap file's contents at most (exact, not sampled)
                    timings[f"{phase}_read_in_bytes"] = swapper.peak_read_in_bytes
            sampler.phase = "done"
            shutil.rmtree(path)
    engine.remove_offload_files()
    dist.destroy_process_group()
    training = {k: v for k, v in sampler.peaks.items() if k in ("forward", "backward", "step", "between")}
    print(json.dumps({"run": args.run, "params": numel, "baseline_bytes": baseline, "after_setup_bytes": after_setup,
                      "end_bytes": end, "peaks_bytes": sampler.peaks,
                      "training_peak_bytes": max(training.values()),
                      "training_peak_phase": max(training, key=training.get),
                      "process_peak_bytes": max(sampler.peaks.values()), "samples": sampler.samples,
                      "step_s": min(steps, default=None), "forward_backward_s": min(forward_backward, default=None),
                      "memory_stats": stats, "config": config, **timings}))


def run_all(args) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="offload_peak_") as nvme_path:
        extra = (("nvme_whole",) if args.whole_pieces else ()) + (("nvme_kept_grads",) if args.release_grads else ())
        for run in ("none", "nvme") + extra:
            command = [sys.executable, "-m", "benchmarks.offload_peak", "--worker", run, "--nvme-path", nvme_path,
                       "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
                       "--steps", str(args.steps), "--threads", str(args.threads), "--vocab", str(args.vocab),
                       "--sub-group-size", str(args.sub_group_size), "--zero", args.zero] + (
                           ["--bf16"] if args.bf16 else []) + (["--release-grads"] if args.release_grads else []) + (
                           ["--checkpoint"] if args.checkpoint else [])
            for flag, value in (("--buffer-count", args.buffer_count), ("--param-buffers", args.param_buffers)):
                if value is not None:
                    command += [flag, str(value)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            if args.mmap_threshold:
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
            output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            runs[run] = json.loads(output.strip().splitlines()[-1])
    base = runs["none"]["memory_stats"]
    # fp32: the master is the parameter shard (fp32_master 0); bf16: the master, the moments and the bf16 shard
    offloaded = base["fp32_master"] + base["optimizer_state"] + base["params"]
    out = {"runs": runs, "offloaded_bytes": offloaded, "load_average": os.getloadavg(),
           "mmap_threshold": args.mmap_threshold or None}
    for name in runs:
        for kind in ("training_peak_bytes", "process_peak_bytes"):
            drop = runs["none"][kind] - runs[name][kind]
            runs[name][kind.replace("_bytes", "_drop_fraction")] = drop / offloaded
    for kind in ("training_peak_drop_fraction", "process_peak_drop_fraction"):
        out[kind] = runs["nvme"][kind]
    return out


def table(result: dict, command: str) -> str:
    runs, offloaded = result["runs"], result["offloaded_bytes"]
    lines = [f"`{command}` (load average {result['load_average'][0]:.1f}; offloaded bytes "
             f"{offloaded / MiB:.0f} MiB: the parameter shard, the fp32 master (in fp32 training the shard itself) and "
             "Adam's moments)", "",
             "| run | after setup | training peak (phase) | backward peak | step peak | between steps | process peak "
             "| peak drop / offloaded (training, process) | step, fwd+bwd (s, best) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in runs.items():
        drop = "" if name == "none" else (f"{run['training_peak_drop_fraction']:.0%}, "
                                          f"{run['process_peak_drop_fraction']:.0%}")
        peaks, mib = run["peaks_bytes"], lambda n: f"{n / MiB:.0f} MiB"  # noqa: E731
        lines.append(f"| {name} | {mib(run['after_setup_bytes'])} | {mib(run['training_peak_bytes'])} "
                     f"({run['training_peak_phase']}) | {mib(peaks['backward'])} | {mib(peaks['step'])} "
                     f"| {mib(peaks['between'])} "
                     f"| {mib(run['process_peak_bytes'])} | {drop} | {run['step_s']:.3f}, "
                     f"{run['forward_backward_s']:.3f} |")
    if "save_s" in next(iter(runs.values())):
        lines += ["", "| run | checkpoint save: process peak, swap file read in at most, s | load: the same |",
                  "| --- | --- | --- |"]
        for name, run in runs.items():
            peaks = run["peaks_bytes"]
            held = {k: f"{run[k] / MiB:.1f} MiB" if k in run else "-" for k in ("save_read_in_bytes",
                                                                                  "load_read_in_bytes")}
            lines.append(f"| {name} | {peaks['save'] / MiB:.0f} MiB, {held['save_read_in_bytes']}, "
                         f"{run['save_s']:.2f} | {peaks['load'] / MiB:.0f} MiB, {held['load_read_in_bytes']}, "
                         f"{run['load_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary nvme_path is made")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=0, help="an Embedding(vocab, width) in front (0: none)")
    parser.add_argument("--whole-pieces", action="store_true",
                        help="also run nvme with pieces bigger than the tile stepped whole (nvme_whole)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=0, help="0: the default (1e9)")
    parser.add_argument("--buffer-count", type=int, default=None, help="offload_optimizer.buffer_count")
    parser.add_argument("--param-buffers", type=int, default=None, help="offload_param.buffer_count")
    parser.add_argument("--zero", default="{}", help="more zero_optimization fields for both runs (JSON), e.g. "
                        "stage 3's prefetch_bucket_size")
    parser.add_argument("--bf16", action="store_true", help="bf16 training (fp32 masters) instead of fp32")
    parser.add_argument("--mmap-threshold", type=int, default=0, help="MALLOC_MMAP_THRESHOLD_ (0: glibc's own)")
    parser.add_argument("--out", default=None, help="append the table (markdown) to this file")
    parser.add_argument("--release-grads", action="store_true",
                        help="give gradient shards' memory back as on CUDA; adds the nvme_kept_grads run")
    parser.add_argument("--checkpoint", action="store_true",
                        help="after training, save a checkpoint and load it back (phases save, load)")
    parser.add_argument("--worker", choices=("none", "nvme", "nvme_whole", "nvme_kept_grads"), default=None)
    parser.add_argument("--nvme-path", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        args.run = args.worker
        worker(args)
        return
    result = run_all(args)
    print(json.dumps(result, indent=1))
    if args.out:
        command = "python -m benchmarks.offload_peak " + shlex.join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "a") as f:
            f.write(table(result, command) + "\n")


if __name__ == "__main__":
    main()
