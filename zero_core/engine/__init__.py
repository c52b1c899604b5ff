"""The ZeRO engine that both front-ends drive: ``zero_core.setup(model, optimizer, config)``.

``ZeroEngine`` (facade.py) is a thin facade; each concern has its own module: ``binding`` (which optimizer
steps which units and groups), ``pending`` (which parameters got a gradient since the last step), ``step``
(reduce, agree, clip, step, zero; the fp16 loss scale), ``masters`` (the fp32 masters on the device or
offloaded: how they step and come into memory), ``norms`` (gradient norms over every rank's shards),
``statistics``, and ``entry`` (``setup``). What differs by stage is asked of the runtime (contracts.Runtime).
"""

from zero_core.engine.binding import OptimizerRef
from zero_core.engine.entry import setup
from zero_core.engine.facade import ConfigLike, ZeroEngine

__all__ = ["ConfigLike", "OptimizerRef", "ZeroEngine", "setup"]
