"""One optimizer tensor per bucket shard instead of one per parameter piece, where that changes nothing.

The optimizer owns one fp32 piece per parameter fragment (master_shards.py), so that each parameter has its
own state and a parameter without a gradient is skipped. Stepping those pieces costs per piece (the
optimizer's Python per parameter, the kernel's per tensor): on a model of many small parameters that is most
of the step. For an elementwise optimizer (every state entry either has the parameter's shape or is one scalar
such as Adam's ``step``), a step over the whole bucket shard does for every element the arithmetic the
per-piece step does, provided every piece of the bucket is stepped and their scalars are equal. Bit for bit where
torch steps a tensor on one thread (small buckets, as in the tests); a large flat tensor is split across torch's
threads at other points than the pieces' ends, and the few elements the fused CPU kernel then computes on its
scalar tail round differently in the last bit (3.7e-9 after three AdamW steps over 400k elements, 2 threads).
So where that holds, the bucket shard is stepped as one tensor:

- its state is flat: each piece's state entries are views of the flat ones (per-element entries), or 0-d
  views of one vector per key that the flat scalar is copied into after each flat step (scalars), so the
  per-piece state that checkpoints and ``state_dict()`` read stays exact;
- the pieces' state is adopted (copied into flat buffers) at the first step after the optimizer created it,
  and again whenever it was replaced (a load); after a step per piece (a parameter without a gradient) the
  views are still exact and only the scalars are compared (pieces whose ``step`` differs stay per piece);
- padding elements (no piece) have zero gradients and zero values on every rank: every elementwise optimizer
  leaves them zero.

Otherwise, and for optimizers not listed here, the pieces are stepped as before.
"""

from __future__ import annotations

import contextlib
from operator import is_
from typing import Iterator, Optional

import torch
from torch import nn

# Elementwise optimizers whose state keys are fixed once created (exact types: a subclass may do anything).
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class FlatBucket:
    """One bucket shard of one MasterShards as a single optimizer parameter, with its flat state."""

    def __init__(self, master: torch.Tensor, indices: list[int], param_indices: list[int], pieces: list[nn.Parameter],
                 starts: list[int]) -> None:
        self.param = nn.Parameter(master, requires_grad=True)  # shares the bucket master's storage
        self.indices = indices  # the pieces' positions in MasterShards.params
        self.param_indices = param_indices  # the pieces' parameters' positions in their part
        self.pieces = pieces
        self.starts = starts
        self.state: Optional[dict] = None  # the flat state, while the pieces' state are views of it
        self._dicts: list = []  # the pieces' state dicts holding the views (a load makes new ones); kept
        self._dict_ids: set = set()  # referenced here, so that no other object can take one of these ids
        self._entries_held: tuple = ([], [], [])  # (state dict, key, view) of every piece entry, as three lists
        self._scalars: dict = {}  # key -> the vector whose 0-d views are the pieces' scalars
        self._entries: dict = {}  # key -> the flat tensor the pieces' views (or scalars) are made from
        self._synced = False  # the flat scalars are the pieces' (no step per piece since the last flat one)

    def ready(self, optimizer: torch.optim.Optimizer, live: set) -> bool:
        """Whether the flat state is in place (adopting the pieces' state first if needed). ``live``: the ids of
        the optimizer's state dicts (a load makes new ones; ids, as hashing a tensor is a Python call)."""
        if self.state is not None and self._dict_ids <= live and all(
                map(is_, map(dict.get, *self._entries_held[:2]), self._entries_held[2])):
            return self._synced or self._resync()
        return self._adopt(optimizer)

    def _resync(self) -> bool:
        """After a step per piece the per-element views are still exact (updated in place); the scalars are
        too if every piece was stepped. Else (Adam's ``step`` differs between pieces) the bucket stays per piece."""
        if not all(bool((vector == vector[0]).all()) for vector in self._scalars.values()):
            return False
        for key, vector in self._scalars.items():
            self.state[key].copy_(vector[0])
        self._synced = True
        return True

    def _adopt(self, optimizer: torch.optim.Optimizer) -> bool:
        """Copy the pieces' state into flat buffers and make the pieces' entries views of them; False (and no
        change) where the pieces' state is missing, uneven or not elementwise."""
        self.state = None
        states = [optimizer.state.get(piece) for piece in self.pieces]
        if not states or not states[0] or any(not s or s.keys() != states[0].keys() for s in states):
            return False
        columns = {key: [s[key] for s in states] for key in states[0]}
        for values in columns.values():
            if not all(isinstance(v, torch.Tensor) for v in values):
                return False
            elementwise = all(v.shape == p.shape for v, p in zip(values, self.pieces))
            if not elementwise and not all(v.dim() == 0 for v in values):
                return False
            if not elementwise and not bool((torch.stack(values) == values[0]).all()):
                return False  # pieces stepped different numbers of times: they keep stepping alone
        flat, scalars, held = {}, {}, ([], [], [])
        for key, values in columns.items():
            if values[0].dim() == 0:
                vector = scalars[key] = torch.stack(values)
                flat[key] = vector[0].clone()
                views = list(vector.unbind())
            else:
                flat[key] = torch.zeros(self.param.shape, dtype=values[0].dtype, device=values[0].device)
                views = [flat[key][start : start + v.numel()] for v, start in zip(values, self.starts)]
                for view, value in zip(views, values):
                    view.copy_(value)
            for state, view in zip(states, views):
                state[key] = view
                for listed, item in zip(held, (state, key, view)):
                    listed.append(item)
        self.state, self._scalars, self._dicts, self._entries_held = flat, scalars, states, held
        self._dict_ids = set(map(id, states))
        self._entries = dict(flat)
        self._synced = True
        return True

    def after_step(self) -> None:
        """The flat step ran: an entry the optimizer replaced (rather than updated in place) is copied back into
        the buffer the pieces view; the flat scalars are copied to the pieces'."""
        for key, entry in self._entries.items():
            if self.state[key] is not entry:
                entry.copy_(self.state[key])
                self.state[key] = entry
        for key, vector in self._scalars.items():
            vector.copy_(self.state[key].expand_as(vector))

    def forget(self) -> None:
        """A step ran per piece: their scalars may differ from the flat ones now (checked before the next flat one)."""
        self._synced = False


def flat_buckets(masters) -> list[FlatBucket]:
    """One FlatBucket per bucket of a MasterShards (made once, kept on it)."""
    buckets = getattr(masters, "flat_buckets", None)
    if buckets is None:
        by_bucket = [([], [], [], []) for _ in masters.buckets]
        for index, (piece, fragment) in enumerate(zip(masters.params, masters.pieces)):
            values = (index, fragment.param_index, piece, fragment.shard_range.start)
            for listed, value in zip(by_bucket[fragment.bucket], values):
                listed.append(value)
        buckets = masters.flat_buckets = [FlatBucket(master, *lists) for master, lists in zip(masters.buckets, by_bucket)]
    return buckets


@contextlib.contextmanager
def stepping_flat(optimizer: torch.optim.Optimizer, buckets: list[FlatBucket]) -> Iterator[None]:
    """For the duration, each group lists the flat parameter of ``buckets`` in place of their pieces, and the
    optimizer holds their flat state; the lists and state come back after (so ``state_dict()`` never sees them)."""
    if not buckets:
        yield
        return
    covered = {id(piece) for bucket in buckets for piece in bucket.pieces}
    saved = [group["params"] for group in optimizer.param_groups]
    for group, members in zip(optimizer.param_groups, saved):
        ids = set(map(id, members))
        group["params"] = [p for p in members if id(p) not in covered] + [
            b.param for b in buckets if id(b.pieces[0]) in ids]
    for bucket in buckets:
        optimizer.state[bucket.param] = bucket.state
    try:
        yield
    finally:
        for group, members in zip(optimizer.param_groups, saved):
            group["params"] = members
        for bucket in buckets:
            optimizer.state.pop(bucket.param, None)
            bucket.param.grad = None
