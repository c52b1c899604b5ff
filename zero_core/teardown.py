"""Clean exit: no collective of the engine is left in flight when the process group goes or the process ends.

Stage 3 prefetches parameters with asynchronous all-gathers and, with ``overlap_comm``, stages 2 and 3 keep a
few reduce-scatters in flight. A handle still pending when ``destroy_process_group()`` runs (or when the
interpreter shuts down) leaves gloo's worker threads owning tensors that Python must free during
finalisation. ``engine.close()`` (also the engine's context-manager exit, and every front-end's teardown)
waits for them and frees what they gathered; a finaliser does the same at interpreter exit for scripts that
never call it. docs/reliability.md describes the guarantees. With NVMe offload, ``close()`` also takes the
swap files' names out of ``nvme_path`` and stops the offload threads (:func:`release_offload`).
"""

from __future__ import annotations

import atexit
import weakref

import torch.distributed as dist

_GROUP_CLOSER_REGISTERED = False


def quiesce(runtime, wait: bool = True) -> None:
    """Finish (or, with ``wait=False`` or without a process group, forget) every collective ``runtime`` still
    has in flight."""
    runtime.quiesce(communicate=wait and dist.is_available() and dist.is_initialized())


def release_offload(offload, param_swap) -> None:
    """The NVMe swap files' names leave ``nvme_path`` and the offload threads stop (the files stay open for the
    engine's later use; zero_core/offload)."""
    if offload is not None:
        offload.teardown()
    if param_swap is not None:
        param_swap.teardown()


def _quiesce_if_alive(runtime_ref: "weakref.ref") -> None:
    runtime = runtime_ref()
    if runtime is not None:
        quiesce(runtime)


def close_at_exit(engine, runtime) -> weakref.finalize:
    """Quiesce ``runtime`` at interpreter exit (atexit) while ``engine`` lives.

    Only a weak reference to the runtime is kept, so a dropped engine is not kept alive by its finaliser. An
    engine is dropped only with its model (the model holds it), and so with its runtime: by the time the
    collector runs the finaliser the weak reference is cleared and nothing communicates, so no rank issues a
    collective at a moment of its collector's choosing."""
    return weakref.finalize(engine, _quiesce_if_alive, weakref.ref(runtime))


def _destroy_default_group() -> None:
    """At interpreter exit, a process group the script left up is destroyed while Python still runs, so gloo's
    worker threads never free a finished collective (ours, or one the script or its framework issued) during
    finalisation, which aborts the process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_group_at_exit() -> None:
    """Register :func:`_destroy_default_group` once; atexit runs it before interpreter finalisation."""
    global _GROUP_CLOSER_REGISTERED
    if not _GROUP_CLOSER_REGISTERED:
        atexit.register(_destroy_default_group)
        _GROUP_CLOSER_REGISTERED = True
