"""A CPU model of ``benchmarks.gpu_activation_checkpoints``'s memory: where the peak is, and of what, without a GPU.

The same residual MLP blocks at stage 3 (one rank, gloo, bf16), scaled so that one block's parameters take the
bytes of one activation (``tokens = 8 x hidden``, as 8192 x 1024 on the GPU) and the prefetch bucket the same
share of the model. A ``TorchDispatchMode`` counts the bytes of every storage alive (through weak references to
the storages, so a tensor autograd keeps counts until it is freed) above what was allocated before the step, in
units of one activation, and records each phase's peak (the GPU benchmark's phases: ``forward``; ``backward``,
autograd's pass; ``gradient flush``, the engine's end-of-backward reduction) and what is alive at the overall peak.

``cpu_checkpointing`` is modelled as on CUDA: a stash's host copy is not counted, and bringing an input back (its
prefetch, or its restore) makes a device copy, in the order ``Stash.restore`` asks for them. As on CUDA (but not
on the CPU, where the engine keeps them) gradient shards are freed between steps. Transport scratch differs from
NCCL's (gloo's coalesced gathers concatenate their inputs), so forward peaks read a little high.

    python -m benchmarks.activation_checkpoints_memory_model [--layers 24] [--hidden 128] [--modes checkpoint cpu]

About 30 s for both modes at the defaults on two CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GPU_PREFETCH_SHARE = 50_000_000 / 201_498_624  # the default prefetch bucket over the GPU run's 24 blocks


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive above where they were when first seen (0 for those an op created), the peak
    of each phase (``phase`` is set from outside) and what made up the overall peak."""

    def __init__(self, host: set) -> None:
        super().__init__()
        self.host = host  # storages (their cdata) that model pinned host memory: not counted
        self.storages: dict = {}  # cdata -> (weak reference, bytes when first seen, description)
        self.freed = 0  # what freed storages that existed before contributed (negative)
        self.phase = "forward"
        self.peaks: dict = {}
        self.peak, self.peak_phase, self.peak_parts = 0, None, []

    def see(self, tensor: torch.Tensor, what: str, created: bool) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        known = self.storages.get(ref.cdata)
        if known is not None and not known[0].expired():
            return
        desc = f"{what} {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
        self.storages[ref.cdata] = (ref, 0 if created else storage.nbytes(), desc)

    def live(self, parts: list | None = None) -> int:
        total = self.freed
        for key, (ref, base, desc) in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
                if key not in self.host:
                    self.freed -= base
                    total -= base
                continue
            if key in self.host:
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes() - base
            total += nbytes
            if parts is not None and nbytes:
                parts.append((nbytes, desc))
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.see(t, str(func), created=False)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.see(t, str(func), created=True)
        now = self.live()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), now)
        if now > self.peak:
            parts: list = []
            self.peak, self.peak_phase = self.live(parts), self.phase
            self.peak_parts = parts
        return out


def model_host_stashes(host: set) -> None:
    """``cpu_checkpointing`` as on CUDA, for stashes on a CPU device: the kept copies count as host memory, and
    prefetch and restore make device copies."""
    from zero_core.checkpointing.stash import Stash

    init = Stash.__init__

    def host_init(self, settings, tensors):
        init(self, settings, tensors)
        if settings.cpu:
            self.on_host = True
            host.update(StorageWeakRef(k.untyped_storage()).cdata for k in self.kept)

    def prefetch(self) -> bool:
        if not self.on_host or self.fetched is not None:
            return False
        self.fetched = [k.clone() for k in self.kept]
        return True

    def local(self):
        if not self.on_host:
            return self.kept
        self.prefetch()
        fetched, self.fetched = self.fetched, None
        return fetched

    Stash.__init__, Stash.prefetch, Stash._local = host_init, prefetch, local


def run_mode(mode: str, layers: int, hidden: int, host: set, steps: int = 2) -> dict:
    """Peaks of the last of ``steps`` steps, in activations (one block's input); ``host``: the host stashes."""
    from torch.autograd import Variable

    import zero_core
    from benchmarks.gpu_activation_checkpoints import build

    torch.manual_seed(0)
    tokens = 8 * hidden
    model = build(layers, hidden)(checkpointed=mode != "none")
    total = sum(p.numel() for p in model.parameters())
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": int(total * GPU_PREFETCH_SHARE)},
              "bf16": {"enabled": True}, "activation_checkpointing": {"cpu_checkpointing": mode == "cpu"}}
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    activation = tokens * hidden * 2
    for step in range(steps):
        counter = LiveBytes(host)
        for unit in engine.runtime.units:  # resized in place (gathered, restored): known from the start
            for t in (unit.full, unit.grad_storage()):
                if t is not None:
                    counter.see(t, "stage-3 unit", created=False)

        def flush_starts() -> None:
            counter.phase = "gradient flush"

        with counter:
            loss = model(x)
            counter.phase = "backward"
            loss.register_hook(lambda grad: Variable._execution_engine.queue_callback(flush_starts))
            engine.backward(loss)
            del loss
        engine.step()
    engine.close()
    parts = Counter()
    for nbytes, desc in counter.peak_parts:
        parts[(round(nbytes / activation, 3), desc)] += 1
    return {"peak": round(counter.peak / activation, 2), "peak_phase": counter.peak_phase,
            "phases": {name: round(value / activation, 2) for name, value in counter.peaks.items()},
            "at_peak": [f"{count} x {size} {desc}" for (size, desc), count in
                        sorted(parts.items(), key=lambda kv: -kv[0][0] * kv[1])[:8]]}


def run(layers: int, hidden: int, modes: list) -> dict:
    """Each mode in this process (its own stage-3 engine each time); needs a process group of one rank."""
    from zero_core import grad_memory
    from zero_core.checkpointing.stash import Stash

    grad_memory.RELEASE_ON_CPU = True  # as on CUDA: gradient shards are freed between steps
    saved = (Stash.__init__, Stash.prefetch, Stash._local)
    host: set = set()
    model_host_stashes(host)
    try:
        result = {"layers": layers, "hidden": hidden, "unit": "activations (one block's input)"}
        for mode in modes:
            result[mode] = run_mode(mode, layers, hidden, host)
        if "checkpoint" in result and "cpu" in result:
            result["peak_saved"] = round(result["checkpoint"]["peak"] - result["cpu"]["peak"], 2)
        return result
    finally:
        Stash.__init__, Stash.prefetch, Stash._local = saved
        grad_memory.RELEASE_ON_CPU = False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.activation_checkpoints_memory_model",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["checkpoint", "cpu"], choices=["checkpoint", "cpu", "none"])
    args = p.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29549")
    os.environ.setdefault("ZERO_CORE_GLOO_ALL_TO_ALL", "0")  # torch's reduce-scatter: no all-to-all scratch
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(json.dumps(run(args.layers, args.hidden, args.modes), indent=2))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
