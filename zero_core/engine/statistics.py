"""What an engine reports about itself: communication volume and the bytes it holds."""

from __future__ import annotations

from zero_core.tools.memory import model_state_bytes

COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")


def comm_stats(comm) -> dict[str, dict[str, int]]:
    """Per collective (each of ``COLLECTIVES`` present, zero if unused): the communicator's counters."""
    empty = {"calls": 0, "elements": 0, "bytes": 0, "in_node_bytes": 0, "cross_node_bytes": 0}
    stats = {name: dict(empty) for name in COLLECTIVES}
    stats.update(comm.stats())
    return stats


def memory_stats(module, inner_optimizers, runtime, comm, weights_ema) -> dict[str, int]:
    """Bytes held on this rank now, by kind (see ZeroEngine.memory_stats)."""
    stats = model_state_bytes(module, inner_optimizers, runtime)
    stats["params"] += comm.paths.secondary_nbytes()  # hpZ's in-node copy of the 16-bit parameters
    if weights_ema is not None:  # the sharded moving average (weights_ema_decay): 4 bytes per master element
        stats["weights_ema"] = sum(t.numel() * t.element_size() for t in weights_ema.tensors())
    return stats
