"""ZeRO-Offload and ZeRO-Infinity for the optimizer, in pure Python (docs/offload.md is the user's guide).

``offload_optimizer: {device: cpu}`` keeps the fp32 master shards and the optimizer state in CPU memory and
steps them there with torch's fused CPU kernels; ``device: nvme`` also swaps them to per-rank files, tile by
tile, between steps; ``offload_param: {device: cpu}`` keeps stage 3's parameter shards in CPU memory (params.py).
The engine calls :func:`attach` once and routes its step through the returned object.
"""

from zero_core.offload.cpu_optimizer import OptimizerOffload, adopt, attach

__all__ = ["OptimizerOffload", "adopt", "attach"]
