"""When the set of parameters in use changes: against DDP(find_unused_parameters=True) with torch's optimizers.

"No gradient, no step": a parameter that got a gradient on no rank during a step's accumulation window keeps
its weights and its optimizer state (AdamW's moments, weight decay, SGD's momentum), as torch's optimizers do
with ``grad=None`` under DDP. The model is a small mixture of experts whose block loops over its experts and
skips those that got no token (as Hugging Face's Mixtral and Qwen-MoE blocks did), plus a branch that is never
used. Cases: experts unused on every rank (every stage); experts used on some ranks only (stages 1 and 2, and
stage 3 with the block declared a leaf through the API or the config; without it stage 3 must stop with an
error naming the block); a layer frozen for two steps and unfrozen; a layer frozen at setup and unfrozen later,
in the optimizer's groups from the start or added with add_param_group (also across a checkpoint save and
resume); two optimizers (AdamW and SGD); gradient accumulation; some of these with the optimizer offloaded to
the CPU or NVMe (and stage 3's parameters to the CPU). DDP cannot average a parameter frozen when it
was built, so the cases with a layer frozen at setup are checked against one process averaging every rank's
loss instead (the same gradients DDP would average). One spawn runs every case.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from stage3_support import capture, full_params, max_abs_diff, unwrap

WORLD = 2
DIM = 8
EXPERTS = 4
STEPS = 5
TOLERANCE = 1e-5
BASE = {"ignore_unused_parameters": True, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
        "stage3_param_persistence_threshold": 0}


class ExpertLoop(nn.Module):
    """Top-1 experts chosen by the batch's expert ids; an expert without a token does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 12), nn.GELU(), nn.Linear(12, DIM))
                                     for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h), dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            tokens = (ids == index).nonzero().squeeze(-1)
            if tokens.numel() == 0:
                continue
            out = out.index_add(0, tokens, expert(h[tokens]) * gates[tokens, index : index + 1])
        return out


class MoENet(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(DIM, DIM)
        self.moe = ExpertLoop()
        self.head = nn.Linear(DIM, 1)
        self.spare = nn.Linear(DIM, DIM)  # never used: no rank ever gives it a gradient

    def forward(self, x: torch.Tensor, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h, ids)
        return F.mse_loss(self.head(h).squeeze(-1), y)


def expert_ids(routing: str, rank: int, step: int, micro: int) -> list[int]:
    """Which experts a rank's tokens go to. "same": every rank the same experts, some unused everywhere;
    "divergent": ranks differ, and expert 3 runs only in step 0's first micro-batch on rank 0."""
    if routing == "same":
        return [step % 3, (step + 1) % 3]
    if rank == 0:
        return [step % 3, 3] if step == 0 and micro == 0 else [step % 3]
    return [0, 2] if step % 2 else [1]


def batch(routing: str, rank: int, step: int, micro: int):
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    choices = expert_ids(routing, rank, step, micro)
    ids = torch.tensor([choices[i % len(choices)] for i in range(6)])
    return torch.randn(6, DIM, generator=gen), ids, torch.randn(6, generator=gen)


def make_optimizers(model: MoENet, two: bool, include_frozen: bool = False) -> list[torch.optim.Optimizer]:
    """AdamW (weight decay on matrices); with ``two``, the head and the spare branch get their own SGD.
    ``include_frozen``: parameters frozen now are in the groups too (torch accepts them)."""
    def mine(name: str, param) -> bool:
        return (include_frozen or param.requires_grad) and (not two or not name.startswith(("head", "spare")))

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and mine(n, p)]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2 and mine(n, p)]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-2)
    if not two:
        return [adamw]
    tail = [*model.head.parameters(), *model.spare.parameters()]
    return [adamw, torch.optim.SGD(tail, lr=5e-2, momentum=0.9, weight_decay=0.1)]


@dataclass(frozen=True)
class Case:
    name: str
    stage: int
    routing: str = "same"
    two: bool = False  # a second optimizer (SGD) for the head and the spare branch
    schedule: str = "none"  # see before_step
    accumulation: int = 1
    resume_after: Optional[int] = None  # save after this step, continue on a fresh model and engine
    replay: bool = True  # on resume, add the groups before loading (else load_checkpoint adds them)
    leaf: str = ""  # stage 3: declare the MoE block a leaf through "api" (set_z3_leaf_modules) or "config"
    offload: str = ""  # offload_optimizer device ("cpu", "nvme"); stage 3 also offload_param cpu ("nvme+params": nvme)

    @property
    def reference(self) -> str:
        """DDP cannot average a parameter frozen when it was constructed: such schedules are checked against
        one process computing every rank's loss (their mean, so the gradients are DDP's average)."""
        return "local" if self.schedule in ("unfreeze", "add-group") else "ddp"


def prepare(model: MoENet, schedule: str) -> None:
    """Before the optimizers exist: "unfreeze" and "add-group" start with the input layer frozen."""
    if schedule in ("unfreeze", "add-group"):
        model.inp.requires_grad_(False)


def before_step(model: MoENet, optimizer, step: int, schedule: str) -> None:
    """"freeze": the input layer is frozen for steps 1 and 2 only. "unfreeze": frozen at setup (in the groups),
    trainable from step 2. "add-group": frozen at setup and in no group; at step 2 it is unfrozen and added as
    a new group with its own learning rate (Lightning's BackboneFinetuning does this)."""
    if schedule == "freeze":
        model.inp.requires_grad_(step not in (1, 2))
    elif schedule == "unfreeze" and step == 2:
        model.inp.requires_grad_(True)
    elif schedule == "add-group" and step == 2:
        model.inp.requires_grad_(True)
        optimizer.add_param_group({"params": list(model.inp.parameters()), "lr": 5e-3})


def replay_groups(model: MoENet, optimizer, steps_done: int, schedule: str) -> None:
    """On resume: what before_step did to the model and the optimizer in the steps already run."""
    for step in range(steps_done):
        before_step(model, optimizer, step, schedule)


def losses(model, rank_or_all, case: Case, step: int, micro: int) -> torch.Tensor:
    if rank_or_all == "all":  # the local reference: every rank's loss, averaged
        return sum(model(*batch(case.routing, r, step, micro)) for r in range(WORLD)) / WORLD
    return model(*batch(case.routing, rank_or_all, step, micro))


def train_reference(case: Case) -> dict:
    rank = dist.get_rank()
    model = MoENet()
    prepare(model, case.schedule)
    optimizers = make_optimizers(model, case.two, include_frozen=case.schedule == "unfreeze")
    wrapped = DistributedDataParallel(model, find_unused_parameters=True) if case.reference == "ddp" else model
    for step in range(STEPS):
        before_step(model, optimizers[0], step, case.schedule)
        for micro in range(case.accumulation):
            last = micro == case.accumulation - 1
            sync = contextlib.nullcontext() if last or case.reference != "ddp" else wrapped.no_sync()
            with sync:
                loss = losses(wrapped, rank if case.reference == "ddp" else "all", case, step, micro)
                (loss / case.accumulation).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def setup(model: MoENet, optimizers, case: Case):
    config = {**BASE, "stage": case.stage}
    if case.leaf == "api":
        zero_core.set_z3_leaf_modules(model, [ExpertLoop])
    elif case.leaf == "config":
        config["leaf_module"] = {"classes": [f"{ExpertLoop.__module__}.ExpertLoop"], "names": ["moe"]}
    if case.offload:
        device = case.offload.removesuffix("+params")
        config["offload_optimizer"] = {"device": device, "nvme_path": NVME_DIR[0]}
        if case.stage == 3:
            config["offload_param"] = {"device": "cpu"}
        if case.offload.endswith("+params"):
            config["offload_param"] = {"device": "nvme", "nvme_path": NVME_DIR[0], "max_in_cpu": 0}
    return zero_core.setup(model, optimizers, config)


def train_zero(case: Case, checkpoint_dir: str) -> dict:
    rank = dist.get_rank()
    model = MoENet()
    prepare(model, case.schedule)
    optimizers = make_optimizers(model, case.two, include_frozen=case.schedule == "unfreeze")
    engine = setup(model, optimizers, case)
    # Stage 1 adds the group through the user's own optimizer object, the others through the engine's facade.
    adder = optimizers[0] if case.stage == 1 else engine.optimizers[0]
    for step in range(STEPS):
        if case.resume_after is not None and step == case.resume_after + 1:
            engine.save_checkpoint(checkpoint_dir)
            model = MoENet(seed=7)  # other weights: the checkpoint must bring everything back
            prepare(model, case.schedule)
            optimizers = make_optimizers(model, case.two, include_frozen=case.schedule == "unfreeze")
            engine = setup(model, optimizers, case)
            adder = optimizers[0] if case.stage == 1 else engine.optimizers[0]
            if case.replay:
                replay_groups(model, adder, step, case.schedule)
                engine.load_checkpoint(checkpoint_dir)
            else:  # the layer is trainable again, and load_checkpoint adds the group saved in the checkpoint
                model.inp.requires_grad_(True)
                engine.load_checkpoint(checkpoint_dir)
        before_step(model, adder, step, case.schedule)
        for micro in range(case.accumulation):
            last = micro == case.accumulation - 1
            with contextlib.nullcontext() if last else engine.no_sync():
                engine.backward(losses(model, rank, case, step, micro) / case.accumulation)
        engine.step()
    return full_params(model)


CASES = [Case(f"same-s{s}", s) for s in (1, 2, 3)] + \
    [Case(f"divergent-s{s}", s, "divergent", two=True, accumulation=2) for s in (1, 2)] + \
    [Case(f"freeze-s{s}", s, two=True, schedule="freeze") for s in (1, 2, 3)] + \
    [Case(f"unfreeze-s{s}", s, schedule="unfreeze") for s in (1, 2, 3)] + \
    [Case(f"add-group-s{s}", s, two=True, schedule="add-group") for s in (1, 2, 3)] + \
    [Case(f"add-group-resume-s{s}", s, schedule="add-group", resume_after=2) for s in (1, 3)] + \
    [Case("add-group-resume-by-load-s2", 2, two=True, schedule="add-group", resume_after=3, replay=False)] + \
    [Case(f"freeze-resume-s{s}", s, schedule="freeze", resume_after=1) for s in (2,)] + \
    [Case("divergent-s3-leaf-api", 3, "divergent", two=True, accumulation=2, leaf="api"),
     Case("divergent-s3-leaf-config", 3, "divergent", leaf="config", schedule="freeze")] + \
    [Case("same-s2-offload-cpu", 2, offload="cpu"), Case("divergent-s1-offload-nvme", 1, "divergent", two=True,
                                                          accumulation=2, offload="nvme"),
     Case("freeze-s3-offload-cpu", 3, two=True, schedule="freeze", offload="cpu"),
     Case("add-group-s2-offload-nvme", 2, two=True, schedule="add-group", offload="nvme"),
     Case("add-group-resume-s3-offload-nvme", 3, schedule="add-group", resume_after=2, offload="nvme"),
     Case("add-group-s3-offload-nvme-params", 3, two=True, schedule="add-group", offload="nvme+params"),
     Case("unfreeze-s3-offload-cpu-params", 3, schedule="unfreeze", offload="cpu+params")]
NVME_DIR = [""]  # the swap directory of the offloaded cases (set by the worker)


def not_a_model_parameter() -> str:
    model = MoENet()
    engine = zero_core.setup(model, make_optimizers(model, False), {**BASE, "stage": 2})
    try:
        engine.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    except ValueError as error:
        return str(error)
    return "accepted"


def leaf_api() -> dict:
    model = MoENet()
    declared = zero_core.set_z3_leaf_modules(model, ["ExpertLoop"])
    found = zero_core.get_z3_leaf_modules(model)
    zero_core.unset_z3_leaf_modules(model, [ExpertLoop])
    try:
        zero_core.set_z3_leaf_modules(model, ["NoSuchBlock"])
        missing = "accepted"
    except ValueError as error:
        missing = str(error)
    return {"declared": [type(m).__name__ for m in declared], "same": found == declared,
            "after_unset": len(zero_core.get_z3_leaf_modules(model)), "missing": missing}


def worker(rank: int, world_size: int, checkpoint_root: str) -> dict:
    results = {}
    references = {}
    NVME_DIR[0] = checkpoint_root
    for case in CASES:
        key = (case.routing, case.two, case.schedule, case.accumulation, case.reference)
        if key not in references:
            references[key] = train_reference(case)
        reference = references[key]
        folder = f"{checkpoint_root}/{case.name}"
        results[case.name] = capture(lambda: max_abs_diff(train_zero(case, folder), reference))
    # The unused branch really is untouched (not just equally moved on both sides).
    model = MoENet()
    start = {n: p.detach().clone() for n, p in model.spare.named_parameters()}
    results["spare-untouched"] = capture(lambda: max_abs_diff(
        {n.removeprefix("spare."): v for n, v in train_zero(Case("spare", 2, two=True), "").items()
         if n.startswith("spare.")}, start))
    results["not-a-model-parameter"] = capture(not_a_model_parameter)
    results["leaf-api"] = capture(leaf_api)
    # Last: without the leaf declaration, stage 3 stops in the first step and names the module to declare.
    results["divergent-s3-no-leaf"] = capture(lambda: train_zero(Case("no-leaf", 3, "divergent"), ""))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(worker, WORLD, str(tmp_path_factory.mktemp("param-sets")), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference(ranks, case):
    reference = "DDP(find_unused_parameters=True)" if case.reference == "ddp" else "the averaged local reference"
    for rank, result in enumerate(ranks):
        diff = unwrap(result[case.name])
        assert diff <= TOLERANCE, f"{case.name}: rank {rank} ends {diff:.3g} from {reference}"


def test_unused_branch_keeps_its_weights(ranks):
    assert unwrap(ranks[0]["spare-untouched"]) == 0.0


def test_add_param_group_with_a_foreign_tensor_names_the_fix(ranks):
    message = unwrap(ranks[0]["not-a-model-parameter"])
    assert "not a parameter of the model" in message and "before setup" in message, message


def test_leaf_module_api(ranks):
    found = unwrap(ranks[0]["leaf-api"])
    assert found["declared"] == ["ExpertLoop"] and found["same"] and found["after_unset"] == 0
    assert "NoSuchBlock" in found["missing"]


def test_divergent_experts_without_a_leaf_name_the_module_to_declare(ranks):
    for result in ranks:
        assert "error" in result["divergent-s3-no-leaf"], "ranks running different experts must not train silently"
        message = result["divergent-s3-no-leaf"]["error"]
        assert "collective mismatch" in message and "leaf" in message, message
        assert "'moe' (ExpertLoop)" in message, message
