"""Stage 2's last bucket (zero_core/replicated/last_bucket.py) works as a stage 1 bucket: it keeps its staging
buffer, its parameters keep their slots as .grad, their hooks are builtins (no Python in backward), and it is
reduced in place when the step needs it, its slice of the staging being this rank's gradient shard. The reduced
gradients must be DDP's average in every case: a plain backward, gradients accumulated under no_sync, two
backward passes before the step, a gradient penalty (a backward through a backward), create_graph (autograd then
replaces .grad instead of accumulating in place), .grad cleared by the user between backward passes, backward
passes all under no_sync, and a backward in which the last layer got no gradient. zero_grad leaves zeros in the
slots; after model.zero_grad() the slots are .grad again before the next forward; an unused parameter is still
named in the error (at the reduction)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

import zero_core
from distributed import run_distributed

CASES = ("plain", "no_sync", "two_backward", "penalty", "create_graph", "cleared", "all_no_sync", "head_unused")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def _reference(rank: int, world_size: int, case: str) -> list[torch.Tensor]:
    """Each parameter's gradient averaged over ranks, from a plain local backward (zeros where none)."""
    model = _model()
    _run(model, lambda loss, **kwargs: loss.backward(**kwargs), rank, case, zero_grad=model.zero_grad)
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world_size
    return grads


def _run(model, backward, rank: int, case: str, no_sync=None, zero_grad=None) -> None:
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 5, generator=g, requires_grad=case == "penalty") for _ in range(2)]
    forward = model[:3] if case == "head_unused" else model  # the last layer's parameters get no gradient
    sync = (no_sync or contextlib.nullcontext) if case in ("no_sync", "cleared", "all_no_sync") else None
    if sync is not None:  # the first micro-batch's gradients wait in the slots
        with sync():
            backward(_loss(forward, xs[0]))
    if case == "cleared":  # the user drops them (set_to_none, as plain torch's zero_grad)
        model.zero_grad(set_to_none=True)
    if case == "two_backward":  # two backward passes before the step, each flushed on its own
        backward(_loss(forward, xs[0]))
    loss = _loss(forward, xs[1], penalty=case == "penalty")
    with sync() if case == "all_no_sync" else contextlib.nullcontext():
        backward(loss, create_graph=True) if case == "create_graph" else backward(loss)


def _loss(forward, x, penalty=False):
    out = forward(x).square().mean()
    if not penalty:
        return out
    (first,) = torch.autograd.grad(out, [x], create_graph=True)
    return out + first.square().sum()


def _python_hooks(param: torch.Tensor) -> int:
    return sum(not isinstance(hook, type(len)) for hook in param._post_accumulate_grad_hooks.values())


def _compare(rank: int, world_size: int) -> dict:
    out = {}
    for case in CASES:
        expected = _reference(rank, world_size, case)
        model = _model()
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), {"stage": 2})
        reducer = engine.runtime.reducer
        last = reducer._last
        _run(model, engine.backward, rank, case, no_sync=engine.no_sync)
        out[case + "_python_hooks"] = [_python_hooks(p) for p in model.parameters()]  # (a reduction arms notes)
        got = [zero_core.safe_get_full_grad(p) for p in model.parameters()]
        out[case] = max((a - b).abs().max().item() for a, b in zip(got, expected))
        engine.step()  # a real update, and zero_grad: every .grad is its slot again, zeroed
        buffer = last.buffer.untyped_storage().data_ptr()
        out[case + "_grads"] = [p.grad is not None and p.grad.untyped_storage().data_ptr() == buffer
                                and not p.grad.any() for p in model.parameters()]
        engine.close()
    # model.zero_grad() after the step (Hugging Face's Trainer calls it every step): before the next forward each
    # .grad is its slot again, so the next backward accumulates there instead of allocating gradients of its own
    model = _model()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), {"stage": 2})
    slots = engine.runtime.reducer._last.slots
    engine.backward(model(torch.randn(4, 5)).square().mean())
    engine.step()
    model.zero_grad()
    out["after_model_zero_grad"] = [p.grad is None for p in model.parameters()]
    loss = model(torch.randn(4, 5)).square().mean()
    out["slots_before_backward"] = [p.grad is slot for p, slot in zip(model.parameters(), slots)]
    engine.backward(loss)
    out["slots_after_backward"] = [p.grad is slot and bool(p.grad.any()) for p, slot in zip(model.parameters(), slots)]
    engine.close()
    # an unused parameter of the last bucket is still named
    model = _model()
    config = {"stage": 2, "ignore_unused_parameters": False}
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), config)
    try:
        engine.backward(model[0](torch.randn(4, 5)).sum())
        engine.step()
        out["unused"] = ""
    except RuntimeError as error:
        out["unused"] = str(error)
    return out


def test_the_last_bucket_reduces_ddps_average():
    for result in run_distributed(_compare, 2, timeout=120):
        for case in CASES:
            assert result[case] < 1e-6, (case, result)
            # after the step every .grad is its slot in the kept staging buffer, zeroed
            assert all(result[case + "_grads"]), (case, result)
            # no Python hook: the model's six parameters fit the one bucket, reduced last
            assert result[case + "_python_hooks"] == [0] * 6, (case, result)
        assert "2.weight" in result["unused"] and "4.bias" in result["unused"], result
        assert all(result["after_model_zero_grad"]) and all(result["slots_before_backward"]), result
        assert all(result["slots_after_backward"]), result


def _reduced_then_unfrozen(rank: int, world_size: int) -> dict:
    """Clip (which reduces), then a parameter frozen at setup becomes trainable before the step: the engine builds
    a new reducer at the step, and the last bucket's reduced gradient must survive the change of reducer."""
    def run(zero: bool):
        model = _model()
        model[0].bias.requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        engine = zero_core.setup(model, optimizer, {"stage": 2}) if zero else None
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
        loss = model(x).square().mean()
        if zero:
            engine.backward(loss)
            norm = engine.clip_grad_norm_(0.05)
        else:
            loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.05)
        model[0].bias.requires_grad_(True)  # no gradient this step: not stepped
        (engine or optimizer).step()
        return float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}

    (norm, zero), (ref_norm, reference) = run(True), run(False)
    return {"norms": (norm, ref_norm), "max_dw": max((zero[n] - reference[n]).abs().max().item() for n in zero)}


def test_a_reduced_gradient_survives_a_new_reducer():
    for result in run_distributed(_reduced_then_unfrozen, 2, timeout=120):
        assert abs(result["norms"][0] - result["norms"][1]) <= 1e-6 * result["norms"][1], result
        assert result["max_dw"] < 1e-6, result
