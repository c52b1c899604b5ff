"""fp32 parity of the ZeRO engine (stages 1 and 2) with DistributedDataParallel.

One spawn per world size runs every case; the DDP reference runs in the same processes on the same
data. A case fails if any rank's weights differ from DDP's by more than float reordering can explain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import partial

import pytest
import torch

from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, make_sgd, train_ddp, train_zero

STEPS = 10
# Float reordering only: sums over ranks and buckets happen in a different order than DDP's.
WEIGHT_TOLERANCE = 1e-5
NORM_RTOL = 1e-5
# Small enough to clip at every step (checked on the reference's norms).
CLIP = {"transformer": 0.5, "mlp": 0.05}
SMALL_BUCKETS = {"reduce_bucket_size": 100, "allgather_bucket_size": 100}


@dataclass(frozen=True)
class Case:
    model: str
    stage: int
    accumulation: int = 1
    no_sync: bool = True
    clip: bool = False  # call engine.clip_grad_norm_ (DDP: clip_grad_norm_)
    clip_in_config: bool = False  # the engine clips inside step() from gradient_clipping
    sgd: bool = False  # SGD with momentum instead of AdamW (its updates scale with the gradient)
    scheduler_after_setup: bool = False  # build the scheduler on engine.optimizer instead
    options: dict = field(default_factory=dict)

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    def config(self) -> dict:
        config = {"stage": self.stage, **self.options}
        if self.clip_in_config:
            config["gradient_clipping"] = CLIP[self.model]
        return config

    def optimizer_fn(self):
        return make_sgd if self.sgd else make_optimizer

    def reference_key(self) -> tuple:
        return self.model, self.accumulation, self.no_sync, self.clip or self.clip_in_config, self.sgd


def cases() -> list[Case]:
    small = SMALL_BUCKETS
    out = []
    for model in ("transformer", "mlp"):
        for stage in (1, 2):
            base = Case(model, stage)
            out += [
                replace(base, options={**small, "overlap_comm": True}),
                replace(base, accumulation=3, clip=True, options={**small, "overlap_comm": False}),
                replace(base, accumulation=3, no_sync=False, clip=True, options={**small, "overlap_comm": True}),
                replace(base, accumulation=3),  # default bucket sizes (5e8): a whole group per bucket
                replace(base, clip=True, options={**small, "reduce_scatter": False}),
                replace(base, accumulation=2, options={**small, "allgather_partitions": False}),
                replace(base, accumulation=2, clip_in_config=True, options=small),
                replace(base, accumulation=2, sgd=True, scheduler_after_setup=True, options=small),
            ]
    return out


def run_reference(case: Case):
    clip = CLIP[case.model] if case.clip or case.clip_in_config else None
    return train_ddp(partial(build_model, case.model), partial(make_batch, case.model), STEPS,
                     case.accumulation, clip, case.no_sync, optimizer_fn=case.optimizer_fn())


def run_case(case: Case, reference) -> dict:
    result, engine, user_optimizer = train_zero(
        partial(build_model, case.model), partial(make_batch, case.model), case.config(), STEPS,
        case.accumulation, CLIP[case.model] if case.clip else None, case.no_sync,
        optimizer_fn=case.optimizer_fn(), scheduler_after_setup=case.scheduler_after_setup,
    )
    model = engine.module
    initial = dict(build_model(case.model).named_parameters())
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    return {
        "names_match": sorted(result.params) == sorted(reference.params),
        "max_dw": max((result.params[n] - reference.params[n]).abs().max().item() for n in reference.params),
        "norms": result.norms,
        "reference_norms": reference.norms,
        "losses": result.losses,
        "reference_losses": reference.losses,
        "engine_lrs": result.lrs,
        "user_lrs": [group["lr"] for group in user_optimizer.param_groups],
        "reference_lrs": reference.lrs,
        "weight_decays": [group["weight_decay"] for group in engine.optimizer.param_groups],
        "is_optimizer": isinstance(engine.optimizer, torch.optim.Optimizer),
        "frozen_names": frozen,
        "frozen_unchanged": all(torch.equal(model.get_parameter(n).detach(), initial[n].detach()) for n in frozen),
        "frozen_without_grad": all(model.get_parameter(n).grad is None for n in frozen),
        "grads_zeroed": all(p.grad is None or not p.grad.any() for p in model.parameters()),
        "tied": getattr(model, "head", None) is None or model.head.weight is model.tok.weight,
    }


def parity_worker(rank, world_size, all_cases):
    references, results = {}, []
    for case in all_cases:
        if case.reference_key() not in references:
            references[case.reference_key()] = run_reference(case)
        try:
            results.append(run_case(case, references[case.reference_key()]))
        except Exception as error:
            error.add_note(f"in case: {case.label()}")
            raise
    return results


def check_case(case: Case, rank: int, r: dict) -> list[str]:
    """Everything that is wrong with one case on one rank, as readable lines."""
    problems = []
    expect = problems.append
    if not r["names_match"]:
        expect("parameter names differ from DDP's")
    if not r["max_dw"] <= WEIGHT_TOLERANCE:
        expect(f"max |w - w_ddp| = {r['max_dw']:.3g} > {WEIGHT_TOLERANCE}")
    if not torch.allclose(torch.tensor(r["losses"]), torch.tensor(r["reference_losses"]), rtol=1e-5, atol=1e-7):
        expect(f"losses {r['losses']} != DDP's {r['reference_losses']}")
    if case.clip:
        if len(r["norms"]) != STEPS or not torch.allclose(
                torch.tensor(r["norms"]), torch.tensor(r["reference_norms"]), rtol=NORM_RTOL):
            expect(f"clip norms {r['norms']} != DDP's {r['reference_norms']}")
    if case.clip or case.clip_in_config:
        if not min(r["reference_norms"]) > CLIP[case.model]:
            expect(f"max_norm {CLIP[case.model]} does not clip every step: norms {r['reference_norms']}")
    if not r["engine_lrs"] == r["user_lrs"] == r["reference_lrs"]:
        expect(f"LRs engine {r['engine_lrs']} / user's optimizer {r['user_lrs']} != DDP's {r['reference_lrs']}")
    if r["weight_decays"] != [0.1, 0.0]:
        expect(f"weight decay per group {r['weight_decays']} != [0.1, 0.0]")
    if not r["is_optimizer"]:
        expect("engine.optimizer is not a torch.optim.Optimizer")
    if (case.model == "mlp") != bool(r["frozen_names"]):
        expect(f"unexpected frozen parameters {r['frozen_names']}")
    if not (r["frozen_unchanged"] and r["frozen_without_grad"]):
        expect("the frozen module changed or got a gradient")
    if not r["grads_zeroed"]:
        expect("step() left non-zero gradients on the model")
    if not r["tied"]:
        expect("the tied LM head no longer shares the embedding's Parameter")
    return [f"rank {rank} [{case.label()}]: {p}" for p in problems]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp32_training_matches_ddp(world_size):
    all_cases = cases()
    per_rank = run_distributed(parity_worker, world_size, all_cases, timeout=360)
    problems = [line for rank, results in enumerate(per_rank)
                for case, r in zip(all_cases, results, strict=True) for line in check_case(case, rank, r)]
    assert not problems, "\n".join(problems)
