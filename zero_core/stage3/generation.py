"""Generation on a stage 3 model: Hugging Face ``generate()`` and hand-written decoding loops.

Two things differ from a training forward:
- Every rank must keep running forward passes until all ranks are done, since each forward gathers the
  partitioned weights collectively. transformers runs its loop that way (``synced_gpus=True``) on its own only
  when it sees DeepSpeed ZeRO-3 or FSDP. We do not pose as FSDP (``_is_fsdp_managed_module`` also changes how
  torch.compile treats a module); instead each submodule with a ``generate`` method that takes ``synced_gpus``
  gets an instance-level wrapper whose default is ``synced_gpus=True`` when there are several ranks. An explicit
  value is passed through. A hand-written loop asks ``GenerationSession.all_finished`` instead.
- A decoding step runs the same modules as the last one, one token later: gathering and releasing every layer
  per token makes generation several times slower than the unsharded model. A session keeps gathered what its
  budget allows (``generation_max_live_parameters``, else ``max_live_parameters``) across the session's no-grad
  forwards and releases it at the end (runtime.py, ``begin_generation``); the wrapper runs ``generate`` in one.
  Where the whole model fits, it is gathered once at the start and the forwards issue no collective: each rank
  then decodes on its own (``synced_gpus`` defaults to False, ``all_finished`` asks nobody), with no per-token
  lockstep between ranks.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


class GenerationSession:
    """``with engine.generation() as session:`` keep gathered parameters across the forwards of a decoding loop
    (no-grad ones), released on leaving. Enter it on every rank; stages 1 and 2 keep nothing (no-op)."""

    def __init__(self, engine, max_live_parameters: Optional[int] = None) -> None:
        config = engine.config
        if max_live_parameters is None:
            max_live_parameters = config.generation_max_live_parameters
        if max_live_parameters is None:
            max_live_parameters = config.max_live_parameters
        if max_live_parameters < 0:
            raise ValueError(f"max_live_parameters must be >= 0 elements, got {max_live_parameters}")
        self.budget = int(max_live_parameters)
        self._runtime = engine.runtime
        self._comm = engine.comm
        self._device = engine.device  # where the flag of all_finished is reduced

    local = False  # set on entering: the whole model is gathered, so forwards issue no collective

    def __enter__(self) -> "GenerationSession":
        self.local = self._runtime.begin_generation(self.budget)
        return self

    def __exit__(self, *exc) -> None:
        self._runtime.end_generation()

    def all_finished(self, finished: bool) -> bool:
        """Whether every rank's sequences are finished (a collective, as transformers' synced_gpus does each
        step): a rank that is done keeps calling the model's forward, with any input, until this is True.
        Where the session holds the whole model gathered (``local``) no rank needs the others: ``finished``."""
        if self.local:
            return finished
        flag = torch.tensor([0.0 if finished else 1.0], device=self._device)
        self._comm.all_reduce(flag, op=dist.ReduceOp.MAX, over="world")
        return flag.item() == 0.0


def generation(model: nn.Module, max_live_parameters: Optional[int] = None) -> GenerationSession:
    """``with zero_core.generation(model):`` the session of the engine set up on ``model`` (see
    ``ZeroEngine.generation``), for code that holds the model but not the engine."""
    engines = model.__dict__.get("_zero_core_engines") or []
    if len(engines) != 1:
        what = "no engine" if not engines else f"{len(engines)} engines"
        raise ValueError(f"zero_core.generation needs a model set up with zero_core.setup once; this "
                         f"{type(model).__name__} has {what}: use engine.generation() on the engine you mean")
    return engines[0].generation(max_live_parameters)


def _takes_synced_gpus(method) -> bool:
    try:
        return "synced_gpus" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def generate_in_sessions(model: nn.Module, engine) -> list[str]:
    """Wrap ``generate`` on every submodule whose method takes ``synced_gpus`` (Hugging Face's): it runs in a
    ``GenerationSession`` and, with several ranks, defaults to ``synced_gpus=True``. Returns their names."""
    wrapped = []
    engine_ref = weakref.ref(engine)  # the model holds the engine; the wrapper on the model does not
    several = engine.topology.world_size > 1
    for name, module in model.named_modules():
        generate = getattr(module, "generate", None)
        if not callable(generate) or "generate" in vars(module) or not _takes_synced_gpus(generate):
            continue
        module.generate = _in_session(generate, engine_ref, several)
        wrapped.append(name)
    return wrapped


def _in_session(generate, engine_ref, several: bool):
    @functools.wraps(generate)
    def generate_in_session(*args, **kwargs):
        engine = engine_ref()
        if engine is None:
            return generate(*args, **kwargs)
        with GenerationSession(engine) as session:
            if several and kwargs.get("synced_gpus") is None:
                # A rank that is done still joins the others' forward passes, unless they gather nothing.
                kwargs["synced_gpus"] = not session.local
            return generate(*args, **kwargs)

    return generate_in_session
