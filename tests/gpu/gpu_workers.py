"""What the GPU tests run in their own process: one rank on one GPU (NCCL), plain bf16 training against the
engine's stages on the same model and data, with peak memory; stage 3 also in program order (no side streams)
and with its collectives' streams recorded."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS = 6
VOCAB, WIDTH, LAYERS, SEQ, BATCH = 512, 256, 4, 64, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float().flatten(0, 1), tokens.roll(-1, 1).flatten())


PINNED_CPU = {"device": "cpu", "pin_memory": True}
OFFLOADS = (  # (result label, stage, offload blocks): each is compared with the same stage not offloaded
    ("zero2_offload", 2, {"offload_optimizer": PINNED_CPU}),
    ("zero3_offload", 3, {"offload_optimizer": PINNED_CPU}),
    ("zero3_offload_param", 3, {"offload_optimizer": PINNED_CPU, "offload_param": PINNED_CPU}),
    ("zero3_offload_pageable", 3, {"offload_optimizer": {"device": "cpu", "pin_memory": False}}),
)


def batches(device):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(STEPS)]


def fresh_peak() -> int:
    """Start a run's peak from what is live now, after freeing what earlier runs dropped: a model and its engine
    refer to each other, so the cycle collector, not the last reference, frees them. Returns the bytes still live
    (what earlier runs' results keep on the GPU), which the run's peaks leave out."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def plain(device) -> dict:
    fresh_peak()
    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches(device):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "peak": torch.cuda.max_memory_allocated(),
            "weights": {n: p.detach().float().cpu() for n, p in model.named_parameters()}}


def spy_on_streams(engine) -> dict:
    """Record, for every all-gather and reduce-scatter stage 3 issues, whether it was issued on its side stream
    (zero_core/stage3/streams.py) rather than the compute stream."""
    streams = engine.runtime.streams
    issued = {"all_gather": [], "reduce_scatter": []}
    for name, side in (("all_gather", streams.gather), ("reduce_scatter", streams.reduce)):
        def spy(*args, _original=getattr(engine.comm, name), _side=side, _name=name, **kwargs):
            issued[_name].append(torch.cuda.current_stream() == _side)
            return _original(*args, **kwargs)

        setattr(engine.comm, name, spy)  # an instance attribute: this engine's communicator only
    return issued


def without_side_streams(engine) -> None:
    """Stage 3 in program order on the compute stream, as on the CPU (the reference for the streamed run)."""
    from zero_core.stage3 import streams

    engine.runtime.streams = streams.NONE
    for unit in engine.runtime.units:
        unit.streams = streams.NONE


def _engine(device, stage: int, reset_peak: bool = True, offload: dict | None = None):
    import zero_core

    if reset_peak:
        fresh_peak()
    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # torch's choice of kernel: the engine's fused one
    return model, zero_core.setup(model, optimizer, {"stage": stage, "bf16": {"enabled": True},
                                                     "stage3_param_persistence_threshold": 0, **(offload or {})})


def engine_run(device, stage: int, side_streams: bool = True, resume_at: int = 0, offload: dict | None = None) -> dict:
    """``resume_at``: after that many steps, save a checkpoint, build a fresh engine and load it, then go on.
    ``offload``: the config's offload blocks (``offload_optimizer``, ``offload_param``)."""
    model, engine = _engine(device, stage, offload=offload)
    issued = None
    if stage == 3 and side_streams:
        issued = spy_on_streams(engine)
    elif stage == 3:
        without_side_streams(engine)
    losses, written_back = [], []
    for index, tokens in enumerate(batches(device)):
        if resume_at and index == resume_at:
            with tempfile.TemporaryDirectory() as directory:
                engine.save_checkpoint(directory)
                del engine, model
                model, engine = _engine(device, stage, reset_peak=False)
                engine.load_checkpoint(directory)
        loss = engine.module(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if offload:  # what the next forward reads: every updated master, cast, in the model's parameters
            masters = engine.full_state_dict(rank0_only=False)
            params = engine.full_state_dict(rank0_only=False, masters=False)
            written_back.append(all(torch.equal(params[n], masters[n].to(params[n].dtype)) for n in params))
    grads_held_after_step = engine.memory_stats()["grads"]  # counting restores nothing
    weights = engine.full_state_dict(rank0_only=False)
    return {"grads_held_after_step": grads_held_after_step, "losses": losses,
            "peak": torch.cuda.max_memory_allocated(), "memory": engine.memory_stats(),
            "weights": {n: weights[n] for n, _ in model.named_parameters()},
            "issued_on_side_stream": issued, "written_back": written_back,
            "host_pinned": [t.is_pinned() for t in _host_tensors(engine)]}


def _train(engine, device) -> list[float]:
    """A step on each of the batches, nothing read between them: the losses."""
    losses = []
    for tokens in batches(device):
        loss = engine.module(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def overlap_run(device, stage: int, overlap: bool, pin: bool = True, backward: bool = False,
                kernel: str = "fused") -> dict:
    """The offloaded step overlapped with the next forward (opt-in) or inline (``overlap_with_forward: false``),
    with ``backward`` each unit's step started during backward (``overlap_with_backward``), nothing read between
    the steps: losses and final weights, how many steps the thread took and how many units backward started.
    ``kernel``: offload_optimizer.host_kernel."""
    block = {"device": "cpu", "pin_memory": pin, "overlap_with_forward": overlap, "overlap_with_backward": backward,
             "host_kernel": kernel}
    # stage 2: several reduce buckets (the last is reduced at the step), so that backward reduces some of them
    buckets = {"reduce_bucket_size": 500_000} if stage == 2 else {}
    model, engine = _engine(device, stage, offload={"offload_optimizer": block, **buckets})
    losses = _train(engine, device)
    weights = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "weights": {n: weights[n] for n, _ in model.named_parameters()},
            "overlapped": engine._offload.overlapped.overlapped_steps,
            "early": engine._offload.overlapped.parts_stepped_in_backward,
            "grad_dtypes": sorted({str(b.dtype) for b in engine._offload.grads.buffers.values()})}


def grads_on_host_run(device, stage: int, moved: bool, clip: float, nvme: bool = False) -> dict:
    """Stages 2-3 with ``offload_optimizer: cpu`` (``nvme``: written to the swap file, nvme_grads.py): each reduced
    gradient shard (stage 2: each reduce bucket's, about 8 here) gives its GPU memory back once its copy to the host
    is under way (``moved``, the default), or keeps it until the step (the move patched out). Losses,
    masters, the gradient held after each backward, a gradient read between backward and step, how many shards
    moved, and setup's peak against the fp32 model built on the GPU (no fp32 master is made there first)."""
    import zero_core
    from zero_core.offload.host_grads import HostGrads

    move, write = HostGrads._move_to_host, HostGrads._write_reduced
    if not moved:
        HostGrads._move_to_host = HostGrads._write_reduced = lambda self, *args: None
    nvme_path = tempfile.mkdtemp() if nvme else None
    offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True} if nvme else PINNED_CPU
    try:
        live = fresh_peak()
        torch.manual_seed(0)
        model = GPT().to(device)
        fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine = zero_core.setup(model, optimizer, {"stage": stage, "bf16": {"enabled": True},
                                                    "gradient_clipping": clip, "reduce_bucket_size": 300_000,
                                                    "stage3_param_persistence_threshold": 0,
                                                    "offload_optimizer": offload})
        setup_peak = torch.cuda.max_memory_allocated() - live
        torch.cuda.reset_peak_memory_stats()
        losses, held, grads = [], [], []
        for index, tokens in enumerate(batches(device)):
            loss = engine.module(tokens)
            engine.backward(loss)
            held.append(engine.memory_stats()["grads"])
            if index == STEPS - 1:
                grads.append(zero_core.safe_get_full_grad(model.blocks[0].up.weight).cpu())
            engine.step()
            losses.append(loss.item())
        masters = engine.full_state_dict(rank0_only=False)
        return {"losses": losses, "held": held, "grads": grads, "moved": engine._offload.grads.moved_to_host,
                "masters": {n: masters[n] for n, _ in model.named_parameters()}, "setup_peak": setup_peak,
                "fp32_bytes": fp32_bytes, "peak": torch.cuda.max_memory_allocated() - live, "live": live}
    finally:
        HostGrads._move_to_host, HostGrads._write_reduced = move, write
        if nvme_path is not None:
            shutil.rmtree(nvme_path, ignore_errors=True)


def delayed_run(device, stage: int, waited: bool) -> dict:
    """The delayed update (``delayed_update_after: 1``) with each step call's copies of the landed masters into the
    model held up on their copy stream (a sleep kernel queued there before them): each part's gather must wait for its
    copies, and the thread for all of them before it changes the masters. ``waited``: the step call also waits for
    them on the host (the reference). Losses, final weights, delayed steps."""
    from zero_core.offload import delayed_update
    from zero_core.offload.placement import _copy_stream

    write = delayed_update.DelayedUpdate._write_into_model

    def held_up(self, entries):
        with torch.cuda.stream(_copy_stream(device, to_device=True)):
            torch.cuda._sleep(100_000_000)  # ~50 ms before the copies start; the compute stream goes on
        copied = write(self, entries)
        if waited:
            _copy_stream(device, to_device=True).synchronize()
        return copied

    delayed_update.DelayedUpdate._write_into_model = held_up
    try:
        block = {"device": "cpu", "pin_memory": True, "delayed_update_after": 1}
        model, engine = _engine(device, stage, offload={"offload_optimizer": block})
        losses = _train(engine, device)
        weights = engine.full_state_dict(rank0_only=False)
        delayed = engine._offload.delayed.delayed_steps
    finally:
        delayed_update.DelayedUpdate._write_into_model = write
    return {"losses": losses, "weights": {n: weights[n] for n, _ in model.named_parameters()}, "delayed": delayed}


def host_syncs(device, stage: int | None, control: bool = False) -> list[str]:
    """Every synchronising CUDA call (torch's sync debug mode) in two training steps after two warm-up steps, each
    with the Python stack that made it. ``stage`` None: plain autocast training. ``control``: a deliberate
    ``loss.item()`` inside the window, which must be caught (the detector works)."""
    if stage is None:
        torch.manual_seed(0)
        model = GPT().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def train(tokens):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
    else:
        model, engine = _engine(device, stage)

        def train(tokens):
            loss = engine.module(tokens)
            engine.backward(loss)
            engine.step()
            return loss
    data = batches(device)
    for tokens in data[:2]:
        train(tokens)
    torch.cuda.synchronize()
    seen: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # torch's own notes about the mode pass
            seen.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for tokens in data[2:4]:
                loss = train(tokens)
                if control:
                    loss.item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return seen


def _host_tensors(engine) -> list:
    """The offloaded optimizer's host master buckets and gradient buffers (empty without offload)."""
    offload = engine._offload
    if offload is None:
        return []
    return [b for part in offload.parts for b in part.master_shards.buckets] + list(offload.grads.buffers.values())


def main(out: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results = {"plain": plain(device)}
    for stage in (1, 2, 3):
        results[f"zero{stage}"] = engine_run(device, stage)
    results["zero3_in_order"] = engine_run(device, 3, side_streams=False)
    results["zero2_resumed"] = engine_run(device, 2, resume_at=STEPS // 2)
    for label, stage, offload in OFFLOADS:
        results[label] = engine_run(device, stage, offload=offload)
    for stage, pin in ((2, True), (3, True), (3, False)):
        for overlap in (True, False):
            label = f"overlap_zero{stage}_{'pinned' if pin else 'pageable'}_{overlap}"
            results[label] = overlap_run(device, stage, overlap, pin)
        # the step started during backward: the thread waits for each unit's (stage 2: bucket's) copy to the host
        results[f"overlap_backward_zero{stage}_{'pinned' if pin else 'pageable'}"] = overlap_run(
            device, stage, True, pin, backward=True)
    for stage in (2, 3):  # the compiled host kernel, inline and started during backward (pinned)
        results[f"compiled_zero{stage}_inline"] = overlap_run(device, stage, False, kernel="compiled")
        results[f"compiled_zero{stage}_backward"] = overlap_run(device, stage, True, backward=True, kernel="compiled")
    for stage in (2, 3):  # reduced gradients on the host only, against kept on the GPU until the step
        for clip in (0.0, 0.05):
            for moved in (True, False):
                label = f"grads_zero{stage}_{'moved' if moved else 'kept'}_{clip}"
                results[label] = grads_on_host_run(device, stage, moved, clip)
        for moved in (True, False):  # nvme: written to the swap file during backward
            results[f"grads_zero{stage}_nvme_{'moved' if moved else 'kept'}"] = grads_on_host_run(
                device, stage, moved, 0.0, nvme=True)
    for stage in (2, 3):
        for waited in (True, False):
            results[f"delayed_zero{stage}_{waited}"] = delayed_run(device, stage, waited)
    results["host_syncs"] = {f"zero{stage}": host_syncs(device, stage) for stage in (1, 2, 3)}
    results["host_syncs"]["plain"] = host_syncs(device, None)
    results["host_syncs"]["control"] = host_syncs(device, 3, control=True)
    dist.destroy_process_group()
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
