"""``checkpoint(function, *args)``: DeepSpeed's ``deepspeed.checkpointing.checkpoint`` on torch.utils.checkpoint.

The recomputation is torch's non-reentrant checkpoint; what changes is how the function's floating tensor inputs
wait for it. torch would keep the input tensors themselves (its recomputation calls ``function(*args)`` again);
here torch gets a closure and no input, so nothing but the ``Stash`` (stash.py) holds them between the forward
and the recomputation, kept as the ``activation_checkpointing`` block says (settings.py). The recomputation sees
the same values with the same ``requires_grad``; gradients still flow to the original inputs through the graph
of the first forward. With the block at its defaults (or under ``no_grad``) this is torch's checkpoint.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as torch_checkpoint

from zero_core.checkpointing.settings import current
from zero_core.checkpointing.stash import Stash

# Keywords that are torch.utils.checkpoint's own; the others go to ``function``.
_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug")


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; they are recomputed in backward.
    ``use_reentrant`` is accepted (Hugging Face passes it) and ignored: this is always non-reentrant."""
    kwargs.pop("use_reentrant", None)
    options = {k: kwargs.pop(k) for k in _OPTIONS if k in kwargs}
    settings = current()
    positions = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()]
    if settings.profiler is not None and torch.is_grad_enabled():
        tensors = [a for a in args if torch.is_tensor(a)]
        function = settings.profiler.timed(function, tensors[0].device if tensors else torch.device("cpu"))
    if not settings.active or not positions or not torch.is_grad_enabled():
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **options, **kwargs)
    device = args[positions[0]].device
    if not settings.stashes:  # synchronize_checkpoint_boundary or profile alone: torch keeps the inputs
        return torch_checkpoint.checkpoint(_bounded(function, settings, device), *args, use_reentrant=False,
                                           **options, **kwargs)
    inputs = list(args)
    state: dict = {"stash": None}

    def run(_anchor):
        call = inputs
        if state["stash"] is not None:  # the recomputation: the inputs come back from their stash
            call = list(inputs)
            for i, value in zip(positions, state["stash"].restore()):
                call[i] = value
        settings.boundary(device)
        out = function(*call, **kwargs)
        settings.boundary(device)
        return out

    # An empty tensor on the inputs' device: torch saves and restores that device's RNG state for the recomputation.
    anchor = torch.empty(0, device=device)
    out = torch_checkpoint.checkpoint(run, anchor, use_reentrant=False, **options)
    state["stash"] = Stash(settings, [inputs[i] for i in positions])
    for i in positions:
        inputs[i] = None  # only the stash holds them now
    return out


def _bounded(function, settings, device):
    def run(*args, **kwargs):
        settings.boundary(device)
        out = function(*args, **kwargs)
        settings.boundary(device)
        return out

    return run
