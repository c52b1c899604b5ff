"""The plain PyTorch loop after ``zero_core.setup``: ``loss.backward(); optimizer.step(); optimizer.zero_grad()``
on the user's own optimizer objects, against DistributedDataParallel running the very same loop.

Covered at stages 1-3: one AdamW with an LR scheduler built before setup; gradient accumulation; clipping by
``engine.clip_grad_norm_`` (DDP: ``torch.nn.utils.clip_grad_norm_``) and by ``gradient_clipping`` in the config;
two optimizers (AdamW and SGD) with schedulers built after setup on the user's optimizers. No scheduler warning
may appear ("lr_scheduler.step() before optimizer.step()" would mean the scheduler stopped seeing the steps).
Some cases offload the optimizer (to the CPU, or NVMe). Also: step(closure), a scheduler on engine.optimizer, and
the error for loss.backward() under fp16 loss scaling.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import lr_factor

WORLD = 2
STEPS = 4
TOLERANCE = 1e-5
MAX_NORM = 0.05  # the MLP's gradient norm is above this at every step: clipping really happens


@dataclass(frozen=True)
class Case:
    stage: int
    accumulation: int = 1
    clip: str = ""  # "engine": engine.clip_grad_norm_; "config": gradient_clipping
    two_optimizers: bool = False  # AdamW + SGD, schedulers built after setup
    offload: str = ""  # offload_optimizer device ("cpu" or "nvme", swapped under the system's temp directory)

    def config(self) -> dict:
        config = {"stage": self.stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50,
                  "stage3_param_persistence_threshold": 0}
        if self.clip == "config":
            config["gradient_clipping"] = MAX_NORM
        if self.offload:
            config["offload_optimizer"] = {"device": self.offload, "nvme_path": tempfile.gettempdir()}
        return config


CASES = [case for stage in (1, 2, 3) for case in (
    Case(stage),
    Case(stage, accumulation=2, clip="engine"),
    Case(stage, clip="config", two_optimizers=True),
    Case(stage, accumulation=2, clip="engine", two_optimizers=True),
)] + [Case(2, offload="cpu"), Case(1, clip="config", two_optimizers=True, offload="cpu"),
      Case(3, accumulation=2, clip="engine", two_optimizers=True, offload="nvme")]


def make_optimizers(model, two: bool) -> list[torch.optim.Optimizer]:
    if not two:
        return [torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)]
    first = [p for n, p in model.named_parameters() if not n.startswith("out.") and p.requires_grad]
    return [torch.optim.AdamW(first, lr=3e-3, weight_decay=0.1),
            torch.optim.SGD(model.out.parameters(), lr=3e-2, momentum=0.9)]


def plain_loop(forward, optimizers, schedulers, clip, accumulation) -> None:
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        for micro in range(accumulation):
            loss = forward(make_batch("mlp", rank, step, micro)) / accumulation
            loss.backward()
        if clip is not None:
            clip(MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        for optimizer in optimizers:
            optimizer.zero_grad()


def run_ddp(case: Case) -> dict:
    model = build_model("mlp")
    ddp = DistributedDataParallel(model)
    optimizers = make_optimizers(model, case.two_optimizers)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in optimizers]
    clip = (lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m)) if case.clip else None
    if case.clip == "config":  # gradient_clipping clips each optimizer's parameters by their own norm, at its step
        clip = lambda m: [torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], m)
                          for o in optimizers]
    plain_loop(lambda b: ddp(*b), optimizers, schedulers, clip, case.accumulation)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_zero(case: Case) -> tuple[dict, list[str]]:
    model = build_model("mlp")
    optimizers = make_optimizers(model, case.two_optimizers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedulers = [] if case.two_optimizers else [torch.optim.lr_scheduler.LambdaLR(optimizers[0], lr_factor)]
        engine = zero_core.setup(model, optimizers if case.two_optimizers else optimizers[0], case.config())
        if case.two_optimizers:  # built on the user's optimizers after setup
            schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in optimizers]
        clip = engine.clip_grad_norm_ if case.clip == "engine" else None
        plain_loop(lambda b: model(*b), optimizers, schedulers, clip, case.accumulation)
        weights = {n: p.detach().clone() for n, p in engine.iter_full_params()}  # copy before the next gather
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
                          or "optimizer.step()" in str(w.message)]
    return weights, scheduler_warnings


def _worker(rank: int, world_size: int) -> list:
    out = []
    for case in CASES:
        expected = run_ddp(case)
        got, scheduler_warnings = run_zero(case)
        diff = max((got[n] - expected[n]).abs().max().item() for n in expected)
        moved = max((expected[n] - build_model("mlp").state_dict()[n]).abs().max().item() for n in expected)
        out.append((case, diff, moved, scheduler_warnings))
    return out


def test_plain_loop_matches_ddp():
    results = run_distributed(_worker, WORLD, timeout=240)
    for rank_results in results:
        for case, diff, moved, scheduler_warnings in rank_results:
            assert moved > 1e-3, f"{case}: the reference did not train"
            assert diff <= TOLERANCE, f"{case}: weights differ from DDP's by {diff:.2e}"
            assert not scheduler_warnings, f"{case}: {scheduler_warnings}"


def _closure_and_facade_worker(rank: int, world_size: int) -> list:
    """optimizer.step(closure) runs the closure; a scheduler on engine.optimizer still counts steps."""
    model = build_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    engine = zero_core.setup(model, optimizer, {"stage": 2})
    batch = make_batch("mlp", rank, 0, 0)

    def closure():
        loss = model(*batch)
        loss.backward()
        return loss

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = optimizer.step(closure)
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(*batch).backward()
        optimizer.step()  # the user's optimizer: the scheduler on the facade must see it
        scheduler.step()
    return [float(loss), changed, [str(w.message) for w in caught], optimizer.param_groups[0]["lr"], fp16_error(rank)]


def fp16_error(rank: int) -> str:
    """With fp16 loss scaling, loss.backward() skips the scale: the user's optimizer.step() must refuse."""
    model = build_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    zero_core.setup(model, optimizer, {"stage": 2, "fp16": {"enabled": True}})
    model(*make_batch("mlp", rank, 0, 0, torch.float16)).backward()
    try:
        optimizer.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_closure_and_scheduler_on_facade():
    for loss, changed, caught, lr, fp16_message in run_distributed(_closure_and_facade_worker, WORLD, timeout=120):
        assert "call engine.backward(loss) instead" in fp16_message, fp16_message
        assert loss > 0 and changed
        assert not [w for w in caught if "lr_scheduler" in w], caught
        assert lr == 0.5e-2
