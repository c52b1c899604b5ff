"""Clean exit: no collective of the engine is left in flight when the process group goes or the process ends.

Stage 3 prefetches parameters with asynchronous all-gathers and, with ``overlap_comm``, stages 2 and 3 keep a
few reduce-scatters in flight. A handle still pending when ``destroy_process_group()`` runs (or when the
interpreter shuts down) leaves gloo's worker threads owning tensors that Python must free during
finalisation. ``engine.close()`` (also the engine's context-manager exit, and every front-end's teardown)
waits for them and frees what they gathered; a finaliser does the same at interpreter exit for scripts that
never call it. docs/reliability.md describes the guarantees.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist


def quiesce(runtime, wait: bool = True) -> None:
    """Finish (or, with ``wait=False`` or without a process group, forget) every collective ``runtime`` still
    has in flight."""
    runtime.quiesce(communicate=wait and dist.is_available() and dist.is_initialized())


def _quiesce_if_alive(runtime_ref: "weakref.ref") -> None:
    runtime = runtime_ref()
    if runtime is not None:
        quiesce(runtime)


def close_at_exit(engine, runtime) -> weakref.finalize:
    """Quiesce ``runtime`` when ``engine`` is collected or, at the latest, at interpreter exit (atexit).

    Only a weak reference to the runtime is kept, so a dropped engine is not kept alive by its finaliser."""
    return weakref.finalize(engine, _quiesce_if_alive, weakref.ref(runtime))
