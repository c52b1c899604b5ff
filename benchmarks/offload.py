"""Offload benchmarks (issue 19), side by side on the same machine and disk:

- ``nvme``: one optimizer pass of the swap (NvmeSwapper over the aio thread pool: read each tile of N fp32
  elements, the next one in flight, and write it back) against a plain dd-style sequential write + fsync + read
  of the same bytes in the same directory; the pages are dropped (posix_fadvise DONTNEED) before reading.
- ``step``: the offloaded CPU step (gradient copy + unscale/clip + tiled fused AdamW, OptimizerOffload.step)
  over N parameters, against a bare ``AdamW(fused=True).step()`` over one N-element parameter; wall time and
  the process's CPU time (every thread), whole tiles or chunks smaller than a piece (``--chunks``).
- ``step-overlap``: the bf16 offloaded step (gradients copied during backward, untimed) three ways, interleaved
  in one process with the bare fused AdamW so that every repeat sees the same load: inline (a CPU-only run),
  the write-back cast on the copy thread while the next tile steps (whole tiles), and on the copy thread in 1M-
  element chunks; beside them the bare step followed by the cast of its 20M results (what inline can at best
  reach: the cast is CPU work wherever it runs, so the CPU-time ratio counts it on any thread).
- ``rss``: peak RSS during training (the kernel's high-water mark, reset after setup) of one rank training a
  ~100M-parameter MLP at stage 3 (world size 1), without offload, with ``offload_optimizer: nvme``, and with
  ``offload_param: nvme`` as well, each in a fresh process.
- ``param``: stage 3 forward+backward and step of an MLP (world size 1) with ``offload_param: nvme``, the shards
  read ahead along the trace (``aio.overlap_events: true``) against read only at each gather (``false``), and
  without offload (the compute and gather floor); three engines in one process, timed in turn, the parameter
  file's pages dropped (fsync + POSIX_FADV_DONTNEED) before each forward so the reads come from the disk; the
  time the training thread waited for parameter reads and for the write-back's writes, in the step and in
  forward+backward.

    python -m benchmarks.offload nvme --numel 67108864 --dir /tmp
    python -m benchmarks.offload step --numel 20000000
    python -m benchmarks.offload step-overlap --numel 20000000 --repeats 15 --threads 1
    python -m benchmarks.offload rss --dir /tmp
    python -m benchmarks.offload param --dir /tmp --width 1024 --layers 16 --tokens 256
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

MiB = 1 << 20


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def plain_pass(directory: str, nbytes: int, block: int) -> float:
    """dd if=/dev/zero of=f bs=block + fsync, then dd if=f of=/dev/null bs=block after dropping the pages."""
    path = os.path.join(directory, "plain_dd.bin")
    buf = bytearray(os.urandom(block))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwrite(fd, buf, offset)
        _drop_cache(fd)
        view = memoryview(buf)
        for offset in range(0, nbytes, block):
            os.preadv(fd, [view], offset)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(path)


def swap_pass(directory: str, numel: int, tile: int, aio: dict, buffer_count: int) -> float:
    """One optimizer pass of the swap without the arithmetic: read every tile (the next one while this one
    'steps') and write it back (overlapping the next), as OptimizerOffload.step does; the file starts on disk."""
    from zero_core.offload.aio import AioPool
    from zero_core.offload.nvme_swap import NvmeSwapper

    swapper = NvmeSwapper(directory, 0, AioPool(**aio), pool_bytes=buffer_count * tile * 4)
    tiles = [[(t, "__master__", t)] for t in (torch.rand(min(tile, numel - s)) for s in range(0, numel, tile))]
    try:
        for items in tiles:
            swapper.swap_out(items).wait()
        _drop_cache(swapper.fd)
        start = time.perf_counter()
        reading, writing = swapper.swap_in(tiles[0]), None
        for index, items in enumerate(tiles):
            reading.wait()
            if index + 1 < len(tiles):
                reading = swapper.swap_in(tiles[index + 1])
            if writing is not None:
                writing.wait()
            writing = swapper.swap_out(items)
        writing.wait()
        os.fsync(swapper.fd)
        return time.perf_counter() - start
    finally:
        swapper.close()


def bench_nvme(args) -> dict:
    nbytes = args.numel * 4
    aio = dict(block_size=args.block_size, queue_depth=args.queue_depth, thread_count=args.thread_count,
               single_submit=False, overlap_events=True)
    plain, swap = [], []
    for _ in range(args.repeats):  # interleaved, so load from other jobs hits both sides alike
        plain.append(plain_pass(args.dir, nbytes, args.block_size))
        swap.append(swap_pass(args.dir, args.numel, args.tile, aio, args.buffer_count))
    gbps = lambda seconds: 2 * nbytes / seconds / 1e9  # noqa: E731  (every byte written once and read once)
    out = {"bytes": nbytes, "aio": aio, "tile_elements": args.tile, "buffer_count": args.buffer_count,
           "plain_GBps": gbps(min(plain)), "swap_GBps": gbps(min(swap)),
           "plain_median_GBps": gbps(statistics.median(plain)), "swap_median_GBps": gbps(statistics.median(swap))}
    out["swap_vs_plain"] = out["swap_GBps"] / out["plain_GBps"]
    return out


def bench_step(args) -> dict:
    from zero_core.config import ZeroConfig
    from zero_core.replicated.flat_param_group import FlatParamGroup
    from zero_core.layout import compute_layout
    from zero_core.offload import OptimizerOffload
    from zero_core.optim.master_shards import step_in_tiles

    n = args.numel
    bare_param = torch.nn.Parameter(torch.randn(n))
    bare_param.grad = torch.randn(n)
    bare = torch.optim.AdamW([bare_param], lr=1e-3, fused=True)

    # The offloaded side: the flat group a stage 1-2 engine builds (one rank) over n elements in parameters of
    # --param elements, its reduced gradient shards on "the device" (here also the CPU), tiles of sub_group_size.
    # --dtype bf16: 16-bit parameters and gradients, so the gradients are copied into fp32 host buffers and the
    # write-back casts (as from a GPU, these copies cannot be avoided); fp32 here: the shards are their own masters.
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sizes = [min(args.param, n - s) for s in range(0, n, args.param)]

    def flat_group():
        params = [torch.nn.Parameter(torch.randn(size, dtype=dtype)) for size in sizes]
        group = FlatParamGroup(params, [f"p{i}" for i in range(len(params))], 0,
                               compute_layout(sizes, 1, args.bucket), rank=0, full_grads=False)
        group.build_masters(torch.float32)
        for grad in group.grad_shards():
            grad.copy_(torch.randn_like(grad))
        return group

    # The same engine step without offload (step_in_tiles: the fp32 gradient copy per tile, the optimizer, the
    # write-back), fused too.
    plain = flat_group()
    plain_optimizer = torch.optim.AdamW(plain.masters, lr=1e-3, fused=True)

    def not_offloaded():
        step_in_tiles(plain_optimizer, [plain], [[True] * len(sizes)], 1.0, None, args.sub_group_size)
        plain.write_back_masters()

    group = flat_group()
    config = ZeroConfig(stage=1, offload_optimizer={"device": "cpu", "host_kernel": args.host_kernel},
                        sub_group_size=args.sub_group_size)
    offload = OptimizerOffload([group], config, rank=0)
    offload.copy_thread = args.copy_thread  # on a CPU-only run the engine copies inline (no accelerator transfers)
    if args.chunk:
        offload.chunk_numel = args.chunk
    offload.chunked = {"auto": None, "on": True, "off": False}[args.chunks]
    optimizer = torch.optim.AdamW(group.masters, lr=1e-3)
    offload.swapped.bind([optimizer])
    used = [[True] * len(sizes)]

    def offloaded():
        offload.step(optimizer, [group], used, 1.0, None)
        group.write_back_masters()  # the runtime's after_step (it waits for the write-back overlapped with the step)

    def copies_only():  # the write-back alone, unoverlapped (fp32 CPU gradients are used in place; from a GPU
        # they would be copied in too)
        for shard, master in zip(group.param_shards(), group.master_shards.buckets):
            shard.copy_(master)

    # The bare step again, over tensors the size of the offloaded pieces: torch's fused kernel runs one parallel
    # region per tensor, and on a loaded machine each region waits for its sibling threads, so with several
    # threads the tensor count alone changes the bare figure (docs/benchmarks.md).
    pieces = [torch.nn.Parameter(torch.randn(m.numel())) for m in group.masters]
    for piece in pieces:
        piece.grad = torch.randn_like(piece)
    bare_pieces = torch.optim.AdamW(pieces, lr=1e-3, fused=True)

    bare_times, off_times, copy_times, plain_times, pieces_times = [], [], [], [], []
    # CPU seconds of the whole process (every thread, the copy thread included): on a machine shared with other
    # jobs this is what the step costs, where wall time also counts the time the scheduler gave to others.
    cpu: dict = {"bare": [], "offloaded": [], "backward_copies": []}
    bare.step(), offloaded(), not_offloaded(), bare_pieces.step()  # state allocation outside the timing
    for _ in range(args.repeats):
        for fn, times in ((bare.step, bare_times), (offloaded, off_times), (copies_only, copy_times),
                          (not_offloaded, plain_times), (bare_pieces.step, pieces_times)):
            if fn is offloaded and args.copied_in_backward:
                start = time.process_time()
                offload.grad_reduced(group, None)  # 16-bit: the copies to the host happen during backward
                cpu["backward_copies"].append(time.process_time() - start)
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - start)
            if times is bare_times or times is off_times:
                cpu["bare" if times is bare_times else "offloaded"].append(time.process_time() - start_cpu)
    b, o = min(bare_times), min(off_times)
    cpu_b, cpu_o = min(cpu["bare"]), min(cpu["offloaded"])
    cpu_out = {"bare_fused_adamw_cpu_s": cpu_b, "offloaded_step_cpu_s": cpu_o, "offloaded_vs_bare_cpu": cpu_b / cpu_o}
    if cpu["backward_copies"]:  # the gradient copies were done during backward: counted here with the step
        copies = min(cpu["backward_copies"])
        cpu_out.update(backward_copies_cpu_s=copies,
                       offloaded_with_backward_copies_vs_bare_cpu=cpu_b / (cpu_o + copies))
    return {**cpu_out, "numel": n, "dtype": args.dtype, "copied_in_backward": args.copied_in_backward,
            "copy_thread": args.copy_thread, "chunks": args.chunks, "chunk": offload.chunk_numel,
            "host_kernel": args.host_kernel,
            "threads": torch.get_num_threads(), "bucket": args.bucket, "param": args.param,
            "engine_step_without_offload_s": min(plain_times),
            "sub_group_size": args.sub_group_size, "bare_fused_adamw_s": b, "offloaded_step_s": o,
            "bare_Gparams_per_s": n / b / 1e9, "offloaded_Gparams_per_s": n / o / 1e9, "offloaded_vs_bare": b / o,
            "bare_median_s": statistics.median(bare_times), "offloaded_median_s": statistics.median(off_times),
            "copies_s": min(copy_times), "bare_same_pieces_s": min(pieces_times),
            "offloaded_vs_bare_same_pieces": min(pieces_times) / o,
            "bare_same_pieces_median_s": statistics.median(pieces_times), "load_average": os.getloadavg()}


def bench_step_overlap(args) -> dict:
    from zero_core.config import ZeroConfig
    from zero_core.layout import compute_layout
    from zero_core.offload import OptimizerOffload
    from zero_core.replicated.flat_param_group import FlatParamGroup

    n = args.numel
    sizes = [min(args.param, n - s) for s in range(0, n, args.param)]
    used = [[True] * len(sizes)]

    def offloaded(copy_thread: bool, chunked: bool):
        params = [torch.nn.Parameter(torch.randn(size, dtype=torch.bfloat16)) for size in sizes]
        group = FlatParamGroup(params, [f"p{i}" for i in range(len(params))], 0,
                               compute_layout(sizes, 1, args.bucket), rank=0, full_grads=False)
        group.build_masters(torch.float32)
        for grad in group.grad_shards():
            grad.copy_(torch.randn_like(grad))
        config = ZeroConfig(stage=1, offload_optimizer={"device": "cpu"}, sub_group_size=args.sub_group_size)
        offload = OptimizerOffload([group], config, rank=0)
        offload.copy_thread, offload.chunked = copy_thread, chunked
        optimizer = torch.optim.AdamW(group.masters, lr=1e-3)
        offload.swapped.bind([optimizer])

        def step():
            offload.step(optimizer, [group], used, 1.0, None)
            group.write_back_masters()

        def prepare():  # the copies to the host that the engine makes during backward (untimed)
            offload.grad_reduced(group, None)

        return prepare, step

    bare_param = torch.nn.Parameter(torch.randn(n))
    bare_param.grad = torch.randn(n)
    bare = torch.optim.AdamW([bare_param], lr=1e-3, fused=True)
    cast_into = torch.empty(n, dtype=torch.bfloat16)

    def bare_and_cast():
        bare.step()
        cast_into.copy_(bare_param.detach())

    nothing = lambda: None  # noqa: E731
    runs = {"bare": (nothing, bare.step), "bare_then_cast": (nothing, bare_and_cast),
            "inline": offloaded(False, None), "copy_thread_tiles": offloaded(True, False),
            "copy_thread_chunks": offloaded(True, True)}
    wall: dict = {name: [] for name in runs}
    cpu: dict = {name: [] for name in runs}
    for prepare, fn in runs.values():  # state allocation outside the timing
        prepare()
        fn()
    for _ in range(args.repeats):
        for name, (prepare, fn) in runs.items():
            prepare()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    out = {"numel": n, "threads": torch.get_num_threads(), "repeats": args.repeats,
           "bare_cpu_ms": min(cpu["bare"]) * 1e3, "bare_wall_ms": min(wall["bare"]) * 1e3}
    for name in runs:
        if name == "bare":
            continue
        out[name] = {"cpu_vs_bare": min(cpu["bare"]) / min(cpu[name]),
                     "cpu_vs_bare_median": statistics.median(cpu["bare"]) / statistics.median(cpu[name]),
                     "wall_vs_bare": min(wall["bare"]) / min(wall[name]),
                     "wall_vs_bare_median": statistics.median(wall["bare"]) / statistics.median(wall[name]),
                     "cpu_ms": min(cpu[name]) * 1e3}
    out["load_average"] = os.getloadavg()
    return out


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def rss_worker(args) -> None:
    """One rank (world size 1) training an MLP of ~args.params parameters at stage 3; prints its peak RSS."""
    import torch.distributed as dist

    import zero_core

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    width = 2048
    layers = max(1, round(args.params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    numel = sum(p.numel() for p in model.parameters())
    config = {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": args.bucket,
              "allgather_bucket_size": args.bucket, "sub_group_size": args.bucket}
    if args.offload != "none":
        config["offload_optimizer"] = {"device": args.offload.removesuffix("+params"), "nvme_path": args.dir}
    if args.offload.endswith("+params"):  # ZeRO-Infinity: the parameter shards in a file too
        config["offload_param"] = {"device": "nvme", "nvme_path": args.dir, "max_in_cpu": 0,
                                   "buffer_count": args.param_buffers}
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    setup_peak = _status_bytes("VmHWM")
    # The training peak, not setup's (model construction holds whole copies for a moment): hand freed heap
    # back to the OS, then reset the kernel's high-water mark (clear_refs 5).
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    after_setup = _status_bytes("VmRSS")
    x = torch.randn(8, width)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.backward(engine.module(x).square().mean())
        engine.step()
    seconds_per_step = (time.perf_counter() - start) / args.steps
    stats = engine.memory_stats()
    print(json.dumps({"offload": args.offload, "params": numel, "setup_peak_rss_bytes": setup_peak,
                      "rss_after_setup_bytes": after_setup, "peak_rss_bytes": _status_bytes("VmHWM"),
                      "seconds_per_step": seconds_per_step,
                      "memory_stats": stats}))
    engine.remove_offload_files()
    dist.destroy_process_group()


def bench_rss(args) -> dict:
    runs = {}
    for offload in ("none", "nvme", "nvme+params"):
        command = [sys.executable, "-m", "benchmarks.offload", "rss-worker", "--offload", offload, "--dir", args.dir,
                   "--params", str(args.params), "--steps", str(args.steps), "--bucket", str(args.bucket),
                   "--param-buffers", str(args.param_buffers)]
        # A fixed mmap threshold (glibc's is otherwise raised by each large free) returns freed tiles to the OS
        # at once instead of leaving them in the heap; every run gets it.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else None
        output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        runs[offload] = json.loads(output.strip().splitlines()[-1])
    base = runs["none"]["memory_stats"]
    # What offload can take away: Adam's state, the masters (in fp32 the parameter shard itself, so counted
    # once) and, with offload_param, the parameter shards (stage 3 holds no gathered copy between steps).
    out = {"runs": runs, "load_average": os.getloadavg()}
    for offload, offloadable in (("nvme", base["fp32_master"] + base["optimizer_state"]),
                                 ("nvme+params", base["fp32_master"] + base["optimizer_state"] + base["params"])):
        saved = runs["none"]["peak_rss_bytes"] - runs[offload]["peak_rss_bytes"]
        out[offload] = {"offloadable_bytes": offloadable, "rss_saved_bytes": saved,
                        "saved_fraction_of_offloadable": saved / offloadable if offloadable else None}
    return out


def bench_param(args) -> dict:
    import torch.distributed as dist

    import zero_core

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    layer_numel = args.width * args.width + args.width
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth, "thread_count": args.thread_count}
    # max_reuse_distance 0: forward releases each layer, so backward gathers (and reads) it again, as when the
    # model does not fit; prefetch_bucket_size: the trace's prefetch gathers that many elements ahead.
    base = {"stage": 3, "param_persistence_threshold": 0, "max_reuse_distance": 0,
            "prefetch_bucket_size": args.prefetch_layers * layer_numel}
    param = {"device": "nvme", "nvme_path": args.dir, "max_in_cpu": 0, "buffer_count": args.param_buffers}
    configs = {"read-ahead": {**base, "offload_param": param, "aio": {**aio, "overlap_events": True}},
               "no read-ahead": {**base, "offload_param": param, "aio": {**aio, "overlap_events": False}},
               "no offload": base}
    engines = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        engines[name] = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    x = torch.randn(args.tokens, args.width)
    # read_wait: what the training thread spent waiting for parameter reads during forward and backward
    # write_wait: what it spent waiting for the parameter write-back after the step (on the aio threads)
    times: dict = {name: {"forward_backward": [], "step": [], "read_wait_in_forward_backward": [],
                          "write_wait_in_step": [], "write_wait_in_forward_backward": [], "read_wait_in_step": []}
             for name in engines}
    for repeat in range(args.repeats + 1):  # the first round records the trace (no read-ahead yet): untimed
        names = list(engines) if repeat % 2 else list(reversed(engines))
        for name in names:
            engine = engines[name]
            swap = engine.runtime.param_swap
            if swap is not None:
                _drop_cache(swap.fd)
            waits = lambda: (swap.read_wait_s, swap.write_wait_s) if swap is not None else (0.0, 0.0)  # noqa: E731
            before = waits()
            start = time.perf_counter()
            engine.backward(engine.module(x).square().mean())
            middle = time.perf_counter()
            after_backward = waits()
            engine.step()
            end = time.perf_counter()
            if repeat:
                times[name]["forward_backward"].append(middle - start)
                times[name]["step"].append(end - middle)
                times[name]["read_wait_in_forward_backward"].append(after_backward[0] - before[0])
                times[name]["write_wait_in_forward_backward"].append(after_backward[1] - before[1])
                times[name]["write_wait_in_step"].append(waits()[1] - after_backward[1])
                times[name]["read_wait_in_step"].append(waits()[0] - after_backward[0])
    out = {"params": args.layers * layer_numel, "shard_bytes_per_layer": layer_numel * 4,
           "load_average_after": os.getloadavg(), "runs": {}}
    for name, engine in engines.items():
        swap = engine.runtime.param_swap
        run = {k: {"median_s": statistics.median(v), "min_s": min(v), "all_s": v} for k, v in times[name].items()}
        if swap is not None:
            run["reads"] = {k: getattr(swap, k) for k in ("reads_ahead", "reads_with_gather", "reads_waited",
                                                          "reads_dropped", "reads_stale", "reads_from_write")}
            run["writes"] = {k: getattr(swap, k) for k in ("writes_async", "writes_in_flight", "writes_waited")}
            run["bytes_read"] = swap.bytes_read
        out["runs"][name] = run
        engine.remove_offload_files()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("nvme", "step", "step-overlap", "rss", "rss-worker", "param"))
    parser.add_argument("--numel", type=int, default=64 * MiB // 4 * 4)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tile", type=int, default=4 * MiB, help="nvme: elements per swapped tile")
    parser.add_argument("--block-size", type=int, default=MiB)
    parser.add_argument("--buffer-count", type=int, default=4, help="nvme: freed tile buffers kept for reuse")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--thread-count", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=5_000_000, help="elements per bucket shard")
    parser.add_argument("--sub-group-size", type=int, default=10_000_000)
    parser.add_argument("--param", type=int, default=2_500_000, help="step: elements per parameter")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="step: parameter dtype")
    parser.add_argument("--copied-in-backward", action="store_true",
                        help="step: the gradients reached the host during backward (the reducer's hook), untimed")
    parser.add_argument("--copy-thread", action="store_true",
                        help="step: the copies around the step on a thread, overlapping the next tile's step (the "
                             "engine does this when the shards are on an accelerator)")
    parser.add_argument("--chunk", type=int, default=0,
                        help="step: elements per chunk of the Adam step, at most (0: the engine's choice, "
                             "chunked_step.chunk_numel)")
    parser.add_argument("--chunks", choices=("auto", "on", "off"), default="auto",
                        help="step: the Adam step in chunks smaller than a piece: the engine's choice (with the copy "
                             "thread only), always, or never (whole tiles, the step before chunks)")
    parser.add_argument("--host-kernel", choices=("fused", "compiled"), default="fused",
                        help="step: offload_optimizer.host_kernel (compiled: the kernel that reads 16-bit gradients)")
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--offload", default="none")
    parser.add_argument("--param-buffers", type=int, default=2, help="rss, param: offload_param.buffer_count")
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20, help="rss: MALLOC_MMAP_THRESHOLD_ (0: unset)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--width", type=int, default=1024, help="param: features per linear layer")
    parser.add_argument("--layers", type=int, default=16, help="param: linear layers")
    parser.add_argument("--tokens", type=int, default=256, help="param: rows of the input batch")
    parser.add_argument("--prefetch-layers", type=int, default=1, help="param: prefetch_bucket_size in layers")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "rss-worker":
        rss_worker(args)
        return
    result = {"nvme": bench_nvme, "step": bench_step, "step-overlap": bench_step_overlap, "rss": bench_rss,
              "param": bench_param}[args.what](args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
