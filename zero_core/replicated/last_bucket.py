"""Stage 2: the bucket reduced last is reduced when the step needs it, in place, as stage 1 reduces its buckets.

Stage 2's hook on each parameter (grad_reducer._grad_ready) stages the gradient and launches the buckets it
completes, so that buckets are reduced while backward goes on. The bucket reduced last (position 0 in the
reducer's order: the parameters backward reaches last) gains nothing from that: nothing is left to overlap its
reduction with. So it works as a stage 1 bucket: a staging buffer taken from the pool once and kept, each of its
parameters' ``.grad`` its slot there for good (autograd accumulates in place), one reduce-scatter in place when
the step (or clipping, or ``reduce_gradients``) needs the gradients, and this rank's slice of the buffer is the
bucket's gradient shard (FlatParamGroup.lend_grad_shard): no copy into a shard, no zeroing after each backward,
and several backward passes before a step are reduced once. Its hooks are builtins autograd calls without
running Python: the ``append`` of ``arrivals`` (which parameters got a gradient: for an unused-parameter error,
and whether a gradient waits when the reducer is replaced) and the engine's note (grad_notes.py). A model whose
parameters fit one bucket (the CPU proxy's 288, docs/benchmarks.md) runs no Python hook in backward.

So these parameters' ``.grad`` are their slots, not None: local gradients from backward to the step, zeros
after ``zero_grad``. A ``.grad`` the user replaced or set to None is taken into the slot (``settle``) before the
next forward (``model.zero_grad()``, which Hugging Face's Trainer calls after every step, would otherwise leave
autograd to allocate a gradient of its own for each) and at the reduction, and the slot is its ``.grad`` again.
"""

from __future__ import annotations

import operator

import torch

_GRAD = operator.attrgetter("grad")


class LastBucketSlots:
    """The kept staging buffer of the bucket reduced last, and its parameters' slots in it."""

    def __init__(self, indices: list[int], params: list[torch.Tensor], slots: list[torch.Tensor],
                 buffer: torch.Tensor) -> None:
        self.indices = indices  # each parameter's index in its flat group, in bucket order
        self.params = params
        self.slots = slots  # each parameter's view of ``buffer``, shaped like it
        self.buffer = buffer  # a pool buffer, held until the reducer closes
        self.arrivals: list[torch.Tensor] = []  # parameters whose gradient arrived since the last reduction
        self._index_of = {id(p): i for p, i in zip(params, indices)}
        self._point_grads()

    def hook(self) -> list:
        """Register the builtin hooks; returns their handles. (The engine's notes hook these parameters
        themselves: GradNotes.hook.)"""
        append = self.arrivals.append
        return [param.register_post_accumulate_grad_hook(append) for param in self.params]

    def _point_grads(self) -> None:
        """Each parameter's ``.grad`` becomes its slot; a gradient it holds already (made trainable after setup,
        or handed back by the reducer this one replaces) is copied in and waits for the reduction."""
        for param, slot in zip(self.params, self.slots):
            if param.grad is not None:
                slot.copy_(param.grad)
                self.arrivals.append(param)
            param.grad = slot

    def settle(self) -> None:
        """A ``.grad`` that is not its slot (set to None or replaced by the user, or by a backward with
        ``create_graph``, where autograd does not accumulate in place) is taken into the slot."""
        grads = list(map(_GRAD, self.params))
        if all(map(operator.is_, grads, self.slots)):
            return
        with torch.no_grad():
            for param, slot, grad in zip(self.params, self.slots, grads):
                if grad is slot:
                    continue
                if grad is None:
                    slot.zero_()  # the user cleared it: whatever the slot held is discarded
                else:
                    slot.copy_(grad)
                param.grad = slot

    def take_arrivals(self) -> set[int]:
        """Indices (in their group) of the parameters that got a gradient since the last call."""
        indices = set(map(self._index_of.__getitem__, map(id, self.arrivals)))
        self.arrivals.clear()
        return indices

    def clear(self) -> None:
        """zero_grad: zeros in every slot, each its parameter's ``.grad``."""
        self.settle()
        self.buffer.zero_()
        self.arrivals.clear()

    def hand_back(self) -> None:
        """The reducer closes (a new one replaces it): each parameter's ``.grad`` becomes a tensor of its own,
        keeping what the slot holds if a gradient waits there, else None."""
        waiting = bool(self.arrivals)
        self.settle()
        for param, slot in zip(self.params, self.slots):
            param.grad = slot.clone() if waiting else None
        self.arrivals.clear()
