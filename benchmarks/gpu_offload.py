"""Issue 19 on one GPU: a GPT of Llama-7B width (d 4096, 32 heads) trained in bf16 with the optimizer on the CPU,
our stage 3 with ``offload_optimizer: {device: cpu, pin_memory: true}`` (``zero3``), with ``offload_param`` as
well (``zero3_param``, what FSDP2's policy offloads), against FSDP2 with ``CPUOffloadPolicy``
(bf16 ``MixedPrecisionPolicy``, torch's fused CPU AdamW), and against DeepSpeed's ZeRO-Offload (``deepspeed``),
each in its own process, one after the other.

    python -m benchmarks.gpu_offload --layers 32                 # about 6.6B parameters
    python -m benchmarks.gpu_offload --layers 8 --impls zero3    # a quick look
    python -m benchmarks.gpu_offload --impls zero3 zero3_delayed --steps 3 --warmup 3   # the delayed update

``zero3`` is the default config (since issue 38 the host step overlaps the next forward,
``overlap_with_forward`` null), ``zero3_overlap`` says ``overlap_with_forward: true`` and ``zero3_inline``
``false``: the inline step's forward+backward is the GPU's alone and its step minus that is the host step, while
an overlapped step's forward+backward column includes waits for the step. Issue 38's exact-overlap target is the
overlapped step <= 1.10x the larger of the two.

``zero3_overlap_bwd`` also starts each unit's host step during backward, once its gradients are on the host
(``overlap_with_backward: true``). ``zero2_inline`` and ``zero2_overlap_bwd`` are the same at stage 2 (each reduce
bucket's step started during backward; the default ``reduce_bucket_size``). ``zero3_inline_compiled`` and
``zero3_overlap_bwd_compiled`` are those two with ``host_kernel: compiled`` (the torch.compile'd host step that reads
bf16 gradients).

``zero3_delayed`` is ``zero3`` with ``delayed_update_after: 1`` (docs/offload.md, "Delayed parameter update"): its
step time against ``zero3``'s forward+backward is issue 38's target for the delayed update (use ``--warmup`` 3 or
more, so that every timed step has an update in flight).

``deepspeed`` (issue 38; DeepSpeed is never a dependency of the project, install it beside it to run this) is
DeepSpeed's ZeRO-3 with the very config ``zero3`` passes to ``zero_core.setup`` (``ZERO3_CONFIG``: ``bf16``
enabled, ``zero_optimization: {stage: 3, offload_optimizer: {device: cpu, pin_memory: true}}``, every other
setting at its default, which our config shares with DeepSpeed's by name and value) plus the batch keys DeepSpeed
requires, and its compiled ``DeepSpeedCPUAdam`` with torch AdamW's defaults (lr 1e-4, betas 0.9/0.999, eps 1e-8,
weight decay 0.01, ``adamw_mode``), what DeepSpeed itself picks for ``AdamW`` under ``offload_optimizer``. The
same model (built in fp32 on the GPU; DeepSpeed casts it to bf16, as our engine keeps bf16 parameters), data and
process group (world size 1 from ``MASTER_ADDR``/``MASTER_PORT``). Its ``cpu_adam`` op is JIT-built by
DeepSpeed on first use (a compiler and ninja are needed; ``benchmarks/gpu_session.sh ds`` builds it first): the
load or build is timed apart (``build s``) and left out of ``setup s``; where DeepSpeed is missing or the build
fails, one line says so and the other implementations still run. On a machine without CUDA the worker runs on
the CPU (gloo; for a quick check of the code path with a tiny ``--width``/``--layers``, DeepSpeed then needs
``DS_ACCELERATOR=cpu``).

Each step is timed from its start until the GPU's compute stream has done its work after the step call (not the
copy streams: copies a step call issued and the next forward waits for per unit, as the delayed update's into the
model, count in the next step's time, as in a training loop without a device-wide synchronise); the
forward+backward column ends at a device-wide synchronise (the gradients' copies to the host included).

Reports per implementation, a row as soon as its process ends: parameters, median step (s) and its forward+backward,
tokens/s, peak GPU memory in training (warm-up steps included) and in setup apart (the model is built in fp32 on
the GPU, as every implementation takes it), peak RSS, setup (model built and wrapped), the DeepSpeed op's load or
build, the whole process's wall time, torch's threads; then each implementation's losses (they should agree to
bf16's precision).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

from .gpt import GPTConfig, batch, build_gpt, num_params

IMPLS = ("zero3", "zero3_inline", "zero3_overlap", "zero3_overlap_bwd", "zero3_param", "zero3_delayed",
         "zero2_inline", "zero2_overlap_bwd", "zero3_inline_compiled", "zero3_overlap_bwd_compiled", "fsdp2",
         "deepspeed")
COMPILED = "_compiled"  # an implementation of ours with offload_optimizer.host_kernel: compiled
# What zero3 passes to zero_core.setup, and DeepSpeed gets as it is (plus its batch keys)
ZERO3_CONFIG = {"bf16": {"enabled": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # torch.optim.AdamW's defaults, lr 1e-4
SKIP = "SKIP "  # a worker's line saying why it measured nothing (DeepSpeed missing, its op did not build)
PROGRESS = "PROGRESS "  # a worker's line saying how far it got: what a process cut by --timeout reports


def progress(what: str) -> None:
    print(PROGRESS + what, flush=True)


class Unavailable(Exception):
    """The implementation cannot run on this machine; the message says why."""


def deepspeed_engine(model: torch.nn.Module, config: GPTConfig) -> tuple:
    """(DeepSpeed's ZeRO-3 engine over ``model`` with ``DeepSpeedCPUAdam``, seconds its cpu_adam op took to
    load or build)."""
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as error:  # noqa: BLE001 - any import failure means: no usable DeepSpeed here
        raise Unavailable(f"deepspeed not importable ({type(error).__name__}: {error})") from error
    start = time.perf_counter()
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # noqa: BLE001 - a failed JIT build is reported, the other implementations run
        raise Unavailable(f"DeepSpeed's cpu_adam did not build ({type(error).__name__}: "
                          f"{str(error)[-300:]})") from error
    build_s = time.perf_counter() - start
    ds_config = {**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": config.batch_size,
                 "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30}
    optimizer = DeepSpeedCPUAdam(model.parameters(), adamw_mode=True, **ADAMW)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    stepper = getattr(engine.optimizer, "optimizer", None)  # ZeRO-3's optimizer wraps the one it steps
    if engine.zero_optimization_stage() != 3 or not engine.zero_cpu_offload() or stepper is not optimizer:
        raise RuntimeError(f"DeepSpeed did not set up ZeRO-3 with its CPU Adam on the CPU (stage "
                           f"{engine.zero_optimization_stage()}, cpu offload {engine.zero_cpu_offload()}, "
                           f"stepping {type(stepper).__name__}): check benchmarks/gpu_offload.py's ds_config")
    return engine, build_s


def thread_summary(timeline: list, called_at: float) -> dict:
    """One overlapped step's parts on the thread (OverlappedStep.timeline) in figures: its waits for gradients to
    arrive, its stepping time and rate (G elements/s) before the step call (beside backward) and after it (beside
    the next forward), and the thread's idle time between parts."""
    before = [t for t in timeline if t.stepped <= called_at]
    after = [t for t in timeline if t.stepped > called_at]

    def rate(parts: list) -> Optional[float]:
        seconds = sum(t.stepped - t.arrived for t in parts)
        return sum(t.numel for t in parts) / seconds / 1e9 if seconds > 0 else None

    busy = sum(t.written - t.taken for t in timeline)
    return {"parts_before_call": len(before), "parts_after_call": len(after),
            "arrival_wait_s": sum(t.arrived - t.taken for t in timeline),
            "stepping_s": sum(t.stepped - t.arrived for t in timeline),
            "write_issue_s": sum(t.written - t.stepped for t in timeline),
            "idle_s": (timeline[-1].written - timeline[0].taken) - busy if timeline else 0.0,
            "rate_before_call": rate(before), "rate_after_call": rate(after),
            "first_part_before_call_s": called_at - timeline[0].taken if timeline else 0.0}


def worker(impl: str, config: GPTConfig, steps: int, warmup: int, profile_step: bool = False,
           overlap_threads: int = 0, chunk: int = 0, one_copy_stream: bool = False) -> dict:
    import torch.distributed as dist

    if one_copy_stream:  # copies to and from the GPU on one stream, as before they had one each
        from zero_core.offload import placement

        placement.SEPARATE_DIRECTIONS = False

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    computed = (lambda: torch.cuda.current_stream().synchronize()) if cuda else (lambda: None)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29557")
    for name in ("RANK", "LOCAL_RANK"):  # DeepSpeed reads these beside the process group
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    t0 = time.perf_counter()
    with device:
        model = build_gpt(config)
    psi = num_params(model)
    build_s = None
    overlapped = None  # ours: the overlapped step, whose thread's time is reported
    offload = {k: dict(v) for k, v in ZERO3_CONFIG["zero_optimization"].items() if k != "stage"}
    name, compiled = impl, impl.endswith(COMPILED)
    impl = impl.removesuffix(COMPILED)  # the rest as for the implementation it is a variant of
    if compiled:  # the compiled host kernel that reads bf16 gradients (docs/offload.md)
        offload["offload_optimizer"]["host_kernel"] = "compiled"
    if impl == "zero3_param":  # parameters too, as FSDP2's CPUOffloadPolicy does
        offload["offload_param"] = {"device": "cpu", "pin_memory": True}
    if impl in ("zero3_inline", "zero3_overlap", "zero2_inline"):  # issue 38: the host step inline, or overlapped
        offload["offload_optimizer"]["overlap_with_forward"] = impl == "zero3_overlap"  # with the next forward
    if impl in ("zero3_overlap_bwd", "zero2_overlap_bwd"):  # issue 38: each unit's (bucket's) step in backward
        offload["offload_optimizer"]["overlap_with_backward"] = True
    if impl == "zero3_delayed":  # issue 38: the host step of step t during step t+1's forward and backward
        offload["offload_optimizer"]["delayed_update_after"] = 1
    if impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                      offload_policy=CPUOffloadPolicy(pin_memory=True))
        for block in model.blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)

        def forward_backward(tokens, targets):
            loss = model(tokens, targets)
            loss.backward()
            return loss.detach()

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif impl == "deepspeed":
        engine, build_s = deepspeed_engine(model, config)
        del model

        def forward_backward(tokens, targets):
            loss = engine(tokens, targets)
            engine.backward(loss)
            return loss.detach()

        step = engine.step
    else:
        import zero_core

        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), **ADAMW), {
            **ZERO3_CONFIG, "zero_optimization": {"stage": 2 if impl.startswith("zero2") else 3, **offload}})
        del model
        overlapped = engine._offload.overlapped
        if overlap_threads:  # the overlapped step's thread count (default: torch's count less one)
            from zero_core.offload import step_thread

            step_thread.use_threads = lambda _count, _set=step_thread.use_threads: _set(overlap_threads)
        if chunk:  # elements per chunk of the host step, at most (default: chunked_step.chunk_numel's choice)
            engine._offload.chunk_numel = chunk

        def forward_backward(tokens, targets):
            loss = engine.module(tokens, targets)
            engine.backward(loss)
            return loss.detach()

        step = engine.step
    setup_s = time.perf_counter() - t0 - (build_s or 0.0)
    progress(f"set up in {setup_s:.1f} s (the compiled host kernel's build included)")
    # Setup's peak (the fp32 model built on the GPU, as each implementation takes it) apart from training's
    setup_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, phases, losses, threads_s, waits_s, summaries = [], [], [], [], [], []
    ours = engine._offload if impl.startswith("zero") else None  # our host step's chunks are counted
    chunks_before = None
    for s in range(warmup + steps):
        tokens, targets = (t.to(device) for t in batch(config, 0, s))
        sync()
        start = time.perf_counter()
        losses.append(forward_backward(tokens, targets))
        sync()
        middle = time.perf_counter()
        if overlapped is not None and overlapped.overlapped_steps and s > warmup:  # the last step's thread (landed)
            threads_s.append(overlapped.thread_seconds)
            waits_s.append(overlapped.waited_seconds)
            summaries.append(thread_summary(overlapped.timeline, overlapped.step_called_at))
        step()
        computed()  # (the next forward waits for any copy the step left running)
        progress(f"step {s}: {time.perf_counter() - start:.2f} s, of which forward+backward {middle - start:.2f} s")
        if s >= warmup:
            times.append(time.perf_counter() - start)
            phases.append(middle - start)
        if s == warmup - 1 and ours is not None:
            chunks_before = ours.chunks_stepped
    profile = None
    if profile_step:  # one more step under the profiler: where the host's step time goes
        from torch.profiler import ProfilerActivity, profile as profiler

        tokens, targets = (t.to(device) for t in batch(config, 0, warmup + steps))
        forward_backward(tokens, targets)
        sync()
        with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step()
            sync()
        profile = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60)
    dist.destroy_process_group()
    return {"profile": profile, "impl": name, "params": psi, "setup_s": setup_s, "build_s": build_s,
            "step_s": statistics.median(times), "losses": [round(float(l), 4) for l in losses],
            "forward_backward_s": statistics.median(phases), "threads": torch.get_num_threads(),
            "overlap_thread_s": statistics.median(threads_s) if threads_s else None,
            "overlap_wait_s": statistics.median(waits_s) if waits_s else None,
            "thread_summary": (sorted(summaries, key=lambda d: d["stepping_s"])[len(summaries) // 2]
                               if summaries else None),  # the step of median stepping time
            "chunks_per_step": (ours.chunks_stepped - chunks_before) / steps if chunks_before is not None else None,
            "tokens_per_s": config.batch_size * config.seq_len / statistics.median(times),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "setup_peak_gpu_gib": setup_peak,
            "moved_to_host": ours.grads.moved_to_host if ours is not None else None,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_offload", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--impls", nargs="+", default=["zero3", "zero3_param", "fsdp2"], choices=IMPLS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600, help="seconds per implementation's process")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step per implementation")
    p.add_argument("--overlap-threads", type=int, default=0, help="zero3_overlap's thread count (default: torch's - 1)")
    p.add_argument("--chunk", type=float, default=0,
                   help="elements per chunk of our host step, at most (default: the engine's)")
    p.add_argument("--one-copy-stream", action="store_true", help="our copies to and from the GPU on one stream")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    config = GPTConfig(vocab=32000, d_model=args.width, n_layer=args.layers, n_head=args.width // 128,
                       seq_len=args.seq_len, batch_size=args.batch_size)
    if args.worker:
        try:
            result = worker(args.worker, config, args.steps, args.warmup, args.profile, args.overlap_threads,
                            int(args.chunk), args.one_copy_stream)
        except Unavailable as why:
            print(SKIP + str(why), flush=True)
            return
        print("RESULT " + json.dumps(result), flush=True)
        return
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"{where}; d {args.width}, {args.layers} layers, batch {args.batch_size}x{args.seq_len}, "
          f"bf16, AdamW, optimizer on the CPU; median of {args.steps} steps after {args.warmup}")
    print("| implementation | params | step s | of which forward+backward | tokens/s | peak GPU GiB, training | "
          "peak GPU GiB, setup | peak RSS GiB | setup s | build s | process s | torch threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for impl in args.impls:  # each row as soon as it is measured: a run cut short keeps the rows it has
        cmd = [sys.executable, "-m", "benchmarks.gpu_offload", "--worker", impl, "--layers", str(args.layers),
               "--width", str(args.width), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--overlap-threads", str(args.overlap_threads),
               "--chunk", str(args.chunk)] + (["--profile"] if args.profile else []) + \
            (["--one-copy-stream"] if args.one_copy_stream else [])
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as cut:  # where it was: the worker's progress lines so far
            said = cut.stdout.decode(errors="replace") if isinstance(cut.stdout, bytes) else (cut.stdout or "")
            where = [l[len(PROGRESS):] for l in said.splitlines() if l.startswith(PROGRESS)]
            where = where[:1] + where[1:][-5:]  # setup, and the last steps
            print(f"{impl}: timed out after {args.timeout} s; {'; '.join(where) or 'before setup ended'}", flush=True)
            continue
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        skipped = [l for l in done.stdout.splitlines() if l.startswith(SKIP)]
        if skipped:
            print(f"{impl}: not measured: {skipped[-1][len(SKIP):]}", flush=True)
            continue
        if done.returncode or not lines:
            print(f"{impl}: exited {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1][7:])
        r["process_s"] = time.perf_counter() - start
        rows.append(r)
        print(f"| {r['impl']} | {r['params'] / 1e9:.2f}B | {r['step_s']:.2f} | {r['forward_backward_s']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {r['peak_gpu_gib']:.1f} | {r.get('setup_peak_gpu_gib', 0.0):.1f} | "
              f"{r['peak_rss_gib']:.1f} | {r['setup_s']:.0f} | "
              f"{'-' if r.get('build_s') is None else format(r['build_s'], '.1f')} | {r['process_s']:.0f} | "
              f"{r['threads']} |", flush=True)
    for r in rows:  # the same model, data and hyperparameters: the losses should agree to bf16's precision
        print(f"{r['impl']} losses: {r['losses']}")
    for r in rows:
        if r.get("chunks_per_step") is not None:
            print(f"{r['impl']}: {r['chunks_per_step']:g} chunks per host step")
    for r in rows:
        if r.get("overlap_thread_s") is not None:
            print(f"{r['impl']}: the overlapped step's thread took {r['overlap_thread_s']:.2f} s (median); the "
                  f"next forward waited {r['overlap_wait_s']:.2f} s for it on the host")
    for r in rows:
        t = r.get("thread_summary")
        if t:
            def g(x):
                return "-" if x is None else f"{x:.2f}"
            print(f"{r['impl']}: thread, its median step: {t['parts_before_call']} parts stepped before the step call "
                  f"at {g(t['rate_before_call'])} G elements/s (first taken {t['first_part_before_call_s']:.2f} s "
                  f"before the call), {t['parts_after_call']} after it at {g(t['rate_after_call'])} G elements/s; "
                  f"stepping {t['stepping_s']:.2f} s, waiting for gradients {t['arrival_wait_s']:.2f} s, issuing "
                  f"write-backs {t['write_issue_s']:.2f} s, idle between parts {t['idle_s']:.2f} s")
        elif r["impl"].removesuffix(COMPILED) in ("zero3_inline", "zero2_inline"):
            host = r["step_s"] - r["forward_backward_s"]
            print(f"{r['impl']}: host step {host:.2f} s, {r['params'] / host / 1e9:.2f} G elements/s")
    for r in rows:
        if r.get("profile"):
            print(f"\n{r['impl']}: one step under torch.profiler\n{r['profile']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
