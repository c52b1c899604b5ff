"""Stage 3: a parameter read directly in the model's forward, outside its own module's hooks, is gathered.

TRL's fused LM head replaces the model's ``forward`` on the instance and multiplies by ``lm_head.weight``
without calling ``lm_head``. Here a small language model gets such a forward (before setup, or after it) and
trains under stage 3 against DDP with the same patched forward, on 2 ranks: with the head in the root group
(gathered by the root's hooks anyway) and without one (``max_live_parameters`` too small for the group, so the
head is gathered when it is read). Outside the model's forward, a read is still the clear error.

Compiled (``torch.compile``, aot_eager) the same forward breaks at its call of ``self.hidden`` (the blocks'
hooks), and the head is then read in a graph of its own: that graph calls into eager code to gather the head
first ([Note: compiled reads] in zero_core/stage3/partitioned_param.py), so it trains to the same weights, with
no recompilation after the first step; compiled code reading a released parameter outside the forward gets the
same clear error.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from stage3_support import full_params, max_abs_diff
from tiny_lm import TinyLM, lm_batch
from zero_core.stage3.partitioned_param import is_released

STEPS = 3
TOLERANCE = 1e-5
CONFIGS = {
    "root group": {"stage": 3, "param_persistence_threshold": 0},
    "no root group": {"stage": 3, "param_persistence_threshold": 0, "max_live_parameters": 100},
}


def fused_forward(self, tokens, targets):
    """What TRL's fused head does: the head's weight is read here, and autograd keeps it for the backward."""
    logits = F.linear(self.hidden(tokens), self.lm_head.weight)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int):
    return lm_batch(step, dist.get_rank())


def train(step_fn, steps=STEPS):
    for step in range(steps):
        step_fn(*batch(step))


def ddp_weights() -> dict:
    model = TinyLM()
    model.forward = MethodType(fused_forward, model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(tokens, targets):
        ddp(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()

    train(step)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def zero_run(config: dict, patch_after_setup: bool, compiled: bool = False) -> dict:
    model = TinyLM()
    if not patch_after_setup:
        model.forward = MethodType(fused_forward, model)
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    if patch_after_setup:
        model.forward = MethodType(fused_forward, model)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    frames = []  # frames dynamo compiled after each step: none after the first

    def step(tokens, targets):
        engine.backward(run(tokens, targets))
        engine.step()
        frames.append(dynamo_frames())

    torch._dynamo.reset()
    train(step)
    if compiled:
        return {"weights": full_params(model), "frames": frames, "outside": compiled_read_outside(model)}
    released_after_step = is_released(model.lm_head.weight)
    with torch.no_grad():
        model(*batch(0))  # an evaluation forward: gathered for it, released at its end
    released_after_eval = is_released(model.lm_head.weight)
    try:
        model.lm_head.weight.sum()
        outside = "no error"
    except RuntimeError as error:
        outside = str(error)
    return {"weights": full_params(model), "released_after_step": released_after_step,
            "released_after_eval": released_after_eval, "outside": outside}


def dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def compiled_read_outside(model) -> str:
    """Compiled code reading the released head after the step, outside any forward."""
    try:
        torch.compile(lambda: model.lm_head.weight.sum(), backend="aot_eager")()
        return "no error"
    except RuntimeError as error:
        return str(error)


def worker(rank: int, world_size: int) -> dict:
    results = {"ddp": ddp_weights()}
    for name, config in CONFIGS.items():
        for after in (False, True):
            results[(name, after)] = zero_run(config, after)
        results[(name, "compiled")] = zero_run(config, False, compiled=True)
    return results


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(worker, 2, timeout=120)[0]


@pytest.mark.parametrize("after", [False, True], ids=["patched before setup", "patched after setup"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_head_read_in_a_patched_forward_trains_as_under_ddp(results, config, after):
    run = results[(config, after)]
    assert max_abs_diff(run["weights"], results["ddp"]) <= TOLERANCE
    assert max_abs_diff(run["weights"], TinyLM().state_dict()) > 1e-3  # it trained


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_head_gathered_on_read_is_released_after_the_step_and_after_an_eval_forward(results, config):
    run = results[(config, False)]
    assert run["released_after_step"] and run["released_after_eval"]


def test_a_read_outside_the_forward_is_still_the_clear_error(results):
    outside = results[("no root group", False)]["outside"]
    assert "'lm_head.weight'" in outside and "GatheredParameters" in outside


@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiled_a_head_read_after_a_helper_method_trains_as_under_ddp(results, config):
    run = results[(config, "compiled")]
    assert max_abs_diff(run["weights"], results["ddp"]) <= TOLERANCE
    assert max_abs_diff(run["weights"], results[(config, False)]["weights"]) <= TOLERANCE  # as the eager run
    assert run["frames"][0] > 0 and run["frames"][-1] == run["frames"][0]  # compiled; nothing after step 1


def test_compiled_code_reading_a_released_parameter_outside_the_forward_gets_the_clear_error(results):
    outside = results[("no root group", "compiled")]["outside"]
    assert "'lm_head.weight'" in outside and "GatheredParameters" in outside
