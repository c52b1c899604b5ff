"""The one-step delayed parameter update of the ZeRO-Offload paper (its "DPU"), opt-in with
``offload_optimizer.delayed_update_after``: the host step of step t runs on a thread while the forward and
backward of step t+1 run, so the CPU's time hides behind the accelerator's.

The rule, as in the paper: after the warm-up's exact steps, the gradients of step t were computed with the
weights after step t-2's update and are applied to the masters after step t-1's, W_t = U(W_{t-1}, g(W_{t-2})).
At the step call of step t: 1. wait for step t-1's update; 2. start writing its masters into the model's parameter
shards, part by part in the order the next forward reads them (the engine's write-back and all-gather that follow
the step spread them); 3. take step t's gradients into host buffers owned by the update (the next backward fills
another set); 4. start step t's update on the thread and return. The next forward reads W_{t-1}. On an
accelerator step 2's copies are asynchronous: each part's reader (its gather) waits for that part's copies on the
accelerator (a stream wait, as for the overlapped step's write-back), so the next forward starts while the later
parts are still on their way, and the thread waits for the copies before it changes the masters they read.

The thread touches only the masters' storage, their optimizer state tensors and objects of its own: it steps a
shallow copy of the user's optimizer whose groups hold stand-in parameters (sharing the masters' storage, with the
taken gradients as ``.grad``) and the hyperparameters as they were at the step call, so an LR scheduler stepped
right after ``step()`` applies from the next step, as with the exact step. The optimizer's hooks and the
counters LR schedulers patch in run on the training thread, once, at the step call. Everything that reads the
masters through the engine (checkpoints, full state dicts, the debugging API, ``offload_resident`` and
``offload_tiles``) waits for the update in flight first; ``engine.close()`` also writes it into the model.
docs/offload.md, "Delayed parameter update".
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Optional

import torch
from torch import nn

from zero_core.optim.kernels import only_params
from zero_core.optim.master_shards import TileEntry, master_tiles, tile_runs, unscale_and_clip
from zero_core.offload.host_masters import write_back_pieces
from zero_core.offload.placement import _copy_stream, copy_between
from zero_core.offload.step_thread import host_step_pool

_WHOLE = 1 << 62  # one tile: the thread steps every piece in one optimizer call


class _Flight(NamedTuple):
    """One optimizer's update on the thread."""

    future: Future
    optimizer: torch.optim.Optimizer
    entries: list[TileEntry]  # the pieces it steps (written into the model at the next step call)
    buffers: dict  # (id(part), bucket) -> the host gradient buffer it reads, reused once it has landed
    stand_ins: list[tuple[nn.Parameter, nn.Parameter]]  # (master piece, stand-in) for state made by the step
    shadow_state: dict


class _Copied:
    """A part whose shards the step call is writing on the accelerator's copy stream: its reader's stream waits for
    the copies (``contracts.wait_for_update``); the host never waits."""

    issued = True  # at the step call, on every rank

    def __init__(self, device: torch.device, event: "torch.cuda.Event") -> None:
        self.device = device
        self.event = event

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


def _frozen(value):
    """A hyperparameter as it is now (a tensor LR a scheduler changes in place is copied)."""
    return value.detach().clone() if torch.is_tensor(value) else value


def _stand_in_step(optimizer: torch.optim.Optimizer, entries: list[TileEntry], grads: list[torch.Tensor]):
    """A shallow copy of ``optimizer`` over stand-ins of the entries' pieces, with the groups' hyperparameters of
    now, and the step function to run on it (the class's own, without the hooks the training thread ran)."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update(optimizer.__dict__)
    stand_in, pairs = {}, []
    shadow_state: dict = defaultdict(dict)
    for entry, grad in zip(entries, grads):
        piece = entry.piece
        double = nn.Parameter(piece.detach(), requires_grad=True)  # the master's storage
        double.grad = grad.view(piece.shape)
        stand_in[id(piece)] = double
        pairs.append((piece, double))
        if piece in optimizer.state:
            shadow_state[double] = optimizer.state[piece]  # the same dict: its tensors are updated in place
    groups = []
    for group in optimizer.param_groups:
        members = [stand_in[id(p)] for p in group["params"] if id(p) in stand_in]
        if members:
            groups.append({**{k: _frozen(v) for k, v in group.items() if k != "params"}, "params": members})
    shadow.param_groups = groups
    shadow.state = shadow_state
    return shadow, inspect.unwrap(type(optimizer).step), pairs, shadow_state


class DelayedUpdate:
    """The delayed host steps of one ``OptimizerOffload`` (``owner``), per optimizer, on one thread."""

    def __init__(self, owner, after: int) -> None:
        self.owner = owner
        self.after = after  # exact steps per optimizer before the delay starts
        self.steps_seen: dict[int, int] = {}  # id(optimizer) -> its steps so far (exact and delayed)
        self.in_flight: dict[int, _Flight] = {}
        # id(optimizer) -> entries whose masters are newer than the model's parameter shards (a landed update)
        self.unwritten: dict[int, list[TileEntry]] = {}
        self.delayed_steps = 0  # a counter: updates started on the thread
        self._pool: Optional[ThreadPoolExecutor] = None

    def takes(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this step of ``optimizer`` is delayed (counts the step)."""
        seen = self.steps_seen.get(id(optimizer), 0)
        self.steps_seen[id(optimizer)] = seen + 1
        return seen >= self.after

    def step(self, optimizer: torch.optim.Optimizer, parts: list, used: list[list[bool]], inv_scale: float,
             clip: Optional[torch.Tensor]) -> None:
        key = id(optimizer)
        self._land(key)  # step t-1's update: its masters are final
        copied = self._write_into_model(self.unwritten.pop(key, []))
        for part in parts:
            part.master_shards.written_back = True  # the write-back after the step must not read masters in flux
        entries = [entry for tile in master_tiles(parts, used, _WHOLE) for entry in tile]
        if not entries:
            return
        grads, buffers = self.owner.grads.take(entries)
        with only_params(optimizer, []):  # its hooks and patched counters (LR schedulers), once, here
            optimizer.step()
        shadow, step_fn, pairs, shadow_state = _stand_in_step(optimizer, entries, grads)

        def update() -> None:
            if copied is not None:
                copied.synchronize()  # the model's shards are being copied from these masters
            with torch.no_grad():
                unscale_and_clip(grads, inv_scale, clip)  # the same arithmetic as the exact step
                step_fn(shadow)
            for _, double in pairs:
                double.grad = None

        if self._pool is None:
            self._pool = host_step_pool("zero-offload-delayed-update")
        self.in_flight[key] = _Flight(self._pool.submit(update), optimizer, entries, buffers, pairs, shadow_state)
        self.delayed_steps += 1

    def _land(self, key: int) -> None:
        """Wait for optimizer ``key``'s update in flight: its state joins the optimizer's, its gradient buffers
        go back to the owner, and its pieces wait to be written into the model."""
        flight = self.in_flight.pop(key, None)
        if flight is None:
            return
        try:
            flight.future.result()
        finally:
            self.owner.grads.give_back(flight.buffers)
        state = flight.optimizer.state
        for piece, double in flight.stand_ins:
            if piece not in state and flight.shadow_state.get(double):
                state[piece] = flight.shadow_state[double]  # a piece's first step made its state
        self.unwritten[key] = flight.entries

    def settle(self) -> None:
        """Every update in flight landed (the masters and optimizer state are those after the last step)."""
        for key in list(self.in_flight):
            self._land(key)

    def take_unwritten(self) -> bool:
        """Whether the model's parameters lag the masters (a landed update not written yet); forgets it (the
        caller writes every master into the model)."""
        lagging = any(self.unwritten.values())
        self.unwritten.clear()
        return lagging

    def stop(self) -> None:
        """Land what is in flight and stop the thread (it starts again at the next delayed step)."""
        self.settle()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _write_into_model(self, entries: list[TileEntry]) -> Optional["torch.cuda.Event"]:
        """Copy the landed masters into the model's parameter shards, part by part in the order the next forward
        reads them: one copy per run of contiguous pieces (on an accelerator asynchronous and cast there,
        placement.py, each part's reader waiting for its copies), or piece by piece for shards offloaded to NVMe.
        Returns an event after every copy to the accelerator (None: none was made), for the thread to wait on."""
        swapped = [entry for entry in entries if entry.part.swap is not None]
        by_part: dict[int, list] = {}
        for run in tile_runs([e for e in entries if e.part.swap is None]):
            by_part.setdefault(id(run[0]), []).append(run)
        parts = self.owner.update_order([runs[0][0] for runs in by_part.values()])
        last = None
        with torch.no_grad():
            for part in parts:
                device = None
                for _, bucket, start, end, _ in by_part[id(part)]:
                    master = part.master_shards.buckets[bucket][start:end]
                    shard = part.param_shards()[bucket][start:end]
                    if shard.data_ptr() != master.data_ptr():
                        copy_between(shard, master)
                        device = shard.device if shard.is_cuda else device
                if device is not None:
                    last = torch.cuda.Event()
                    last.record(_copy_stream(device, to_device=True))
                    part.update_in_flight = _Copied(device, last)
            if swapped:
                write_back_pieces(swapped)
        return last
