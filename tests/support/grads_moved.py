"""The check shared by the tests of gradient shards that leave the accelerator once reduced (to host buffers with
``offload_optimizer: cpu``, to the swap file with ``nvme``): the run that moves them trains bit for bit as the run
that keeps them."""

from __future__ import annotations

import torch

from models import build_model


def assert_trained_alike(kept: dict, moved: dict, where: str, model: str) -> None:
    """Losses, clip norms, parameters, masters and the gradients read between backward and step are equal; after
    each backward the moved run's shards hold no memory and the kept run's do; the kept run trained."""
    assert kept["losses"] == moved["losses"], (where, kept["losses"], moved["losses"])
    assert kept["norms"] == moved["norms"], (where, kept["norms"], moved["norms"])
    for key in ("params", "masters"):
        for name, value in kept[key].items():
            assert torch.equal(value, moved[key][name]), f"{where}: {key} {name} differs"
    for a, b in zip(kept["grads"], moved["grads"]):
        assert torch.equal(a, b), f"{where}: the gradient read between backward and step differs"
    assert kept["moved"] == 0 and all(held > 0 for held in kept["held"]), (where, kept["held"])
    assert moved["moved"] > 0, where
    assert all(held == 0 for held in moved["held"]), (where, moved["held"])  # no shard kept its memory
    start = build_model(model).state_dict()
    assert any(not torch.equal(v.float(), start[n].float()) for n, v in kept["params"].items()
               if n in start), f"{where}: the reference run did not train"


def train_steps(engine, model: str, rank: int, steps: int, micro: int, dtype: torch.dtype, scheduler,
                clip_norm_type: float = 0.0, read_grad: bool = True) -> dict:
    """``steps`` steps of ``micro`` backward passes each: the losses, the gradient bytes held after each backward,
    the norms of a user's clip (``clip_norm_type``), and (``read_grad``) a gradient read with the debugging API
    between the last backward and its step; then the parameters, masters and shards moved."""
    import zero_core
    from models import make_batch
    from stage3_support import full_params

    first = next(p for p in engine.module.parameters() if p.dim() == 2)
    losses, norms, held, grads = [], [], [], []
    for step in range(steps):
        for m in range(micro):
            loss = engine.module(*make_batch(model, rank, step, m, dtype=dtype))
            engine.backward(loss)
            losses.append(loss.float().item())
        held.append(engine.memory_stats()["grads"])
        if clip_norm_type:
            norms.append(float(engine.clip_grad_norm_(0.05, norm_type=clip_norm_type)))
        if step == steps - 1 and read_grad:
            grads.append(zero_core.safe_get_full_grad(first))
        engine.step()
        scheduler.step()
    return {"losses": losses, "norms": norms, "held": held, "grads": grads, "params": full_params(engine.module),
            "masters": engine.full_state_dict(rank0_only=False), "moved": engine._offload.grads.moved_to_host}
