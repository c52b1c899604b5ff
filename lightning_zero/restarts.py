"""The process group of ``ZeroStrategy`` and ``ZeroFabricStrategy``: DDP's, except that under torchrun each
restarted attempt gets keys of its own in the agent's store (zero_core/comm/restarts.py says why), so a
``--max-restarts`` restart connects instead of hanging on the dead attempt's addresses."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import _init_dist_connection

from zero_core import attempt_store


def init_process_group(strategy: Any) -> None:
    """What Lightning's ``DDPStrategy`` does after it set the world ranks, with the attempt's store."""
    strategy._process_group_backend = strategy._get_process_group_backend()
    kwargs: dict[str, Any] = {"timeout": strategy._timeout}
    kwargs["device_id"] = strategy.root_device if strategy.root_device.type != "cpu" else None
    store = attempt_store(strategy._timeout)
    if store is not None:
        kwargs["store"] = store
    _init_dist_connection(strategy.cluster_environment, strategy._process_group_backend, **kwargs)
