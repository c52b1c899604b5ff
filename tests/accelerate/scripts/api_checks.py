"""Behaviour of ZeroAccelerator's API on 2 ranks: errors that name the fix, fp16 overflow agreed across ranks,
models prepared without an optimizer, rank-0-only state at stage 3. Called from parity.py (same launch)."""

import contextlib
import copy

import torch
from torch import nn

import zero_core

from common import make_accelerator, rank


def raises(fn, error, *words) -> str:
    """'ok' if fn() raises ``error`` whose message holds every word; else what happened instead."""
    try:
        fn()
    except error as caught:
        missing = [w for w in words if w not in str(caught)]
        return "ok" if not missing else f"message lacks {missing}: {caught}"
    except Exception as caught:  # the wrong kind of error
        return f"{type(caught).__name__}: {caught}"
    return "no error"


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))


def error_checks() -> dict:
    accelerator = make_accelerator({"stage": 2})
    model, other = small(), small()
    checks = {
        "optimizer_alone": raises(lambda: accelerator.prepare(torch.optim.SGD(other.parameters(), lr=0.1)),
                                  ValueError, "same accelerator.prepare"),
        "optimizer_of_two_models": raises(
            lambda: accelerator.prepare(model, other, torch.optim.SGD([*model.parameters(), *other.parameters()])),
            ValueError, "parameters of several models"),
    }
    model = small()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.randn(4, 5)).sum())
    checks["clip_subset"] = raises(lambda: accelerator.clip_grad_norm_(model[0].parameters(), 1.0),
                                   ValueError, "model.parameters()")
    checks["clip_value"] = raises(lambda: accelerator.clip_grad_value_(model.parameters(), 1.0),
                                  NotImplementedError, "clip_grad_norm_")
    checks["not_ddp"] = type(model).__name__
    return checks


def stage3_checks(work) -> dict:
    accelerator = make_accelerator({"stage": 3, "param_persistence_threshold": 0})
    model = small()
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    state = accelerator.get_state_dict(model)
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, len(state))
    return {
        "state_keys": counts,  # rank 0: the whole state; other ranks: nothing
        "save_model_needs_flag": raises(lambda: accelerator.save_model(model, work / "never"), ValueError,
                                        "stage3_gather_16bit_weights_on_model_save"),
    }


def alone_checks() -> dict:
    """A model prepared without its optimizer is still under ZeRO: gradients are reduced as DDP would."""
    accelerator = make_accelerator({"stage": 1, "reduce_scatter": False})
    model = accelerator.prepare(small())
    inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank()))
    accelerator.backward(model(inputs).pow(2).mean())
    grad = model[0].weight.grad.clone()
    everyone = [torch.empty_like(grad) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, grad)
    return {"engine": accelerator.zero_engine(model).config.stage, "grads_agree": all(torch.equal(g, grad) for g in everyone)}


def late_backward_counted() -> float:
    """Stage 1 with all-reduce reduces right after the synchronising backward; one more backward before the
    step is reduced again at the step, as DDP reduces every backward: max |zero - ddp| after the step."""
    accelerator = make_accelerator({"stage": 1, "reduce_scatter": False}, gradient_accumulation_steps=1)
    model = small()
    reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank())
    for _ in range(2):
        x = torch.randn(4, 5, generator=g)
        accelerator.backward(model(x).sum())
        reference(x).sum().backward()
    optimizer.step()
    sgd.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def overflow_checks() -> dict:
    """An fp16 overflow on rank 1 only makes every rank skip the step, and the scheduler waits."""
    accelerator = make_accelerator({"stage": 2}, mixed_precision="fp16", gradient_accumulation_steps=1)
    model = small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(4, 5)).float().pow(2).mean()
    accelerator.backward(loss * (float("inf") if rank() == 1 else 1.0))
    optimizer.step()
    scheduler.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"skipped": optimizer.step_was_skipped, "params_unchanged": unchanged,
            "lr": optimizer.param_groups[0]["lr"], "loss_scale": accelerator.zero_engine(model).loss_scale}


def two_fp16_models() -> str:
    accelerator = make_accelerator({"stage": 1}, mixed_precision="fp16")
    first, second = small(), small()
    accelerator.prepare(first, torch.optim.SGD(first.parameters(), lr=0.1))
    return raises(lambda: accelerator.prepare(second, torch.optim.SGD(second.parameters(), lr=0.1)),
                  NotImplementedError, "use bf16")


def late_backward_checks() -> dict:
    """zero_core itself: a backward after reduce_gradients() (which clip_grad_norm_ calls) and before step() is
    refused with an error where it would be lost; with whole averaged gradients (stage 1, reduce_scatter: false)
    it counts like DDP's. Per case: the error text, or max |zero - ddp|."""
    out = {}
    for stage, config, under_no_sync in ((1, {}, False), (2, {}, True), (1, {"reduce_scatter": False}, False)):
        model = small()
        reference = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        engine = zero_core.setup(model, torch.optim.SGD(model.parameters(), lr=1.0), {"stage": stage, **config})
        sgd = torch.optim.SGD(reference.parameters(), lr=1.0)
        g = torch.Generator().manual_seed(rank())
        first, second = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
        model(first).sum().backward()
        reference(first).sum().backward()
        engine.reduce_gradients()
        key = f"stage{stage}" + ("_allreduce" if config else "")
        try:
            with engine.no_sync() if under_no_sync else contextlib.nullcontext():
                model(second).sum().backward()
        except RuntimeError as error:
            out[key] = str(error)
            continue
        reference(second).sum().backward()
        engine.step()
        sgd.step()
        out[key] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return out


def run_api_checks(work) -> dict:
    return {"errors": error_checks(), "stage3": stage3_checks(work), "alone": alone_checks(),
            "overflow": overflow_checks(), "two_fp16_models": two_fp16_models(),
            "late_backward_counted": late_backward_counted(),
            "late_backward": late_backward_checks()}
