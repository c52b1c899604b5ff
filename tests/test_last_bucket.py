"""Stage 2's last bucket without Python per gradient (zero_core/replicated/last_bucket.py): once its staging is
open, its parameters' hooks are a list's append until the end-of-backward flush. The reduced gradients must be
DDP's average in every case the Python hook handled: a plain backward, gradients left from no_sync (the staging
then keeps the Python hooks), two backward passes before the step, a gradient penalty (a backward through a
backward), create_graph (autograd then replaces .grad instead of accumulating in place); and an unused
parameter is still named in the error."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

import zero_core
from distributed import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


# per case: whether the last bucket's hooks were swapped when its last gradient arrived, in each backward
SWAPPED = {"plain": [True], "no_sync": [False, False], "two_backward": [True, True], "penalty": [True],
           "create_graph": [False]}


def _reference(rank: int, world_size: int, case: str) -> list[torch.Tensor]:
    """Each parameter's gradient averaged over ranks, from a plain local backward."""
    model = _model()
    _run(model, lambda loss, **kwargs: loss.backward(**kwargs), rank, case)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world_size
    return grads


def _run(forward, backward, rank: int, case: str, no_sync=None) -> None:
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 5, generator=g, requires_grad=case == "penalty") for _ in range(2)]
    if case == "no_sync":  # the first micro-batch's gradients wait in .grad, then the staging opens with them
        with no_sync() if no_sync else contextlib.nullcontext():
            backward(_loss(forward, xs[0]))
    if case == "two_backward":  # two backward passes before the step, each flushed on its own
        backward(_loss(forward, xs[0]))
    loss = _loss(forward, xs[1], penalty=case == "penalty")
    backward(loss, create_graph=True) if case == "create_graph" else backward(loss)


def _loss(forward, x, penalty=False):
    out = forward(x).square().mean()
    if not penalty:
        return out
    (first,) = torch.autograd.grad(out, [x], create_graph=True)
    return out + first.square().sum()


def _compare(rank: int, world_size: int) -> dict:
    out = {}
    for case in SWAPPED:
        expected = _reference(rank, world_size, case)
        model = _model()
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), {"stage": 2})
        last = engine.runtime.reducer._last
        swapped = []  # whether the hooks were swapped when the first layer's gradient (the last to come) arrived
        model[0].weight.register_post_accumulate_grad_hook(lambda p: swapped.append(last.swapped))
        _run(engine.module, engine.backward, rank, case, no_sync=engine.no_sync)
        out[case + "_swapped"] = swapped
        got = [zero_core.safe_get_full_grad(p) for p in model.parameters()]
        out[case] = max((a - b).abs().max().item() for a, b in zip(got, expected))
        out[case + "_swapped_after"] = engine.runtime.reducer._last.swapped
    # an unused parameter of the last bucket is still named
    model = _model()
    config = {"stage": 2, "ignore_unused_parameters": False}
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), config)
    try:
        engine.backward(model[0](torch.randn(4, 5)).sum())
        out["unused"] = ""
    except RuntimeError as error:
        out["unused"] = str(error)
    return out


def test_the_last_bucket_reduces_what_the_python_hook_did():
    for result in run_distributed(_compare, 2, timeout=120):
        assert {case: result[case + "_swapped"] for case in SWAPPED} == SWAPPED, result
        for case in SWAPPED:
            assert result[case] < 1e-6, (case, result)
            assert result[case + "_swapped_after"] is False, (case, result)
        assert "2.weight" in result["unused"] and "4.bias" in result["unused"], result
