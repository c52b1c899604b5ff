"""ZeRO stage 3 behaviour: communication and memory per rank against the paper, the live-parameter budget,
errors on partitioned access, inference, the partition cache, bf16, and ranks that take different code paths.

Psi is the trainable parameter count and N the world size. Every bound is computed here from the model's sizes
(stage3_support.expected_units recomputes the documented partitioning); only padding (each unit padded to a
multiple of N) and AdamW's scalar `step` counters may add to the formulas. One spawn per world size runs every
section; a section that raises is reported by the tests that read it.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from reference import make_optimizer
from stage3_support import (WideMLP, batch, build, capture, expected_units, full_params, generate, max_abs_diff,
                            module_gather_numel, root_group_gather_numel, run_once, unwrap)

PARTITIONED = {"stage": 3, "param_persistence_threshold": 0}
FP32_BYTES, ADAM_STATES = 4, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LIVE_BUDGETS = (("wide", 0), ("wide", 1200), ("transformer", 2000))  # (model, max_live_parameters)


def psi(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def one_step(engine, name, rank, step, dtype=torch.float32):
    engine.backward(engine.module(*batch(name, rank, step, 0, dtype)))
    engine.step()


def counted(engine, run):
    """``run()``'s result and the collectives it issued."""
    engine.reset_comm_stats()
    result = run()
    return result, engine.comm_stats()


# -- communication ------------------------------------------------------------------------------------------
def communication(rank: int, name: str) -> dict:
    """Elements moved by each phase of one step after a warm-up step (max_reuse_distance=0, all partitioned)."""
    model = build(name)
    engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "max_reuse_distance": 0})
    one_step(engine, name, rank, 0)
    phases = {}
    with engine.no_sync():
        _, phases["no_sync micro-batch"] = counted(engine, lambda: engine.backward(model(*batch(name, rank, 1, 0))))
    loss, phases["forward"] = counted(engine, lambda: model(*batch(name, rank, 1, 1)))
    _, phases["backward"] = counted(engine, lambda: engine.backward(loss))
    _, phases["step"] = counted(engine, engine.step)
    return phases


def check_communication(name: str, world_size: int, phases: dict) -> list[str]:
    model = build(name)
    units = expected_units(model, world_size)
    tied = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False)) - psi(model)
    padding = sum(u["padded"] - u["numel"] for u in units)
    # The last module's units may stay gathered from its forward into its backward: no element is gathered
    # in between, so even max_reuse_distance=0 keeps them (docs/stage3.md); its backward gather is skipped.
    last = module_gather_numel(model, model.head if name == "transformer" else model.out, world_size)
    bounds = {"forward": (psi(model) + tied, psi(model) + tied + padding + world_size),
              "backward": (psi(model) + tied - last, psi(model) + tied + padding + world_size)}
    group = root_group_gather_numel(model, world_size)
    if group:  # the modules outside the blocks: gathered once by the root (tied ones too), kept into its backward;
        last = module_gather_numel(model, model.blocks[-1], world_size)  # the last hooked module is the last block
        bounds = {"forward": (psi(model), psi(model) + padding + world_size),
                  "backward": (psi(model) - group - last, psi(model) + padding + world_size - group)}
    problems = []
    for phase, (least, most) in bounds.items():
        moved = phases[phase]["all_gather"]["elements"]
        if not least <= moved <= most:
            problems.append(f"{phase} all-gathered {moved} elements, expected {least}..{most} (Psi = {psi(model)}, "
                            f"tied {tied}, root group {group}, {last} kept by the last module, padding {padding})")
    step = {k: v for k, v in phases.items() if k != "no_sync micro-batch"}
    reduced = sum(p["reduce_scatter"]["elements"] for p in step.values())
    if not psi(model) <= reduced <= psi(model) + padding:
        problems.append(f"reduce-scattered {reduced} elements in the step, expected Psi = {psi(model)} + padding")
    if phases["no_sync micro-batch"]["reduce_scatter"]["calls"]:
        problems.append(f"a backward under no_sync() reduce-scattered (docs/core-api.md: no communication): "
                        f"{phases['no_sync micro-batch']['reduce_scatter']}")
    if phases["step"]["all_gather"]["calls"]:
        problems.append(f"step() all-gathered though nothing is persistent: {phases['step']['all_gather']}")
    # The step all-reduces one-byte flags: overflow, and per trainable tensor "got a gradient on some rank".
    flags = sum(1 for p in model.parameters() if p.requires_grad) + 1
    if any(p["all_reduce"]["bytes"] > flags + 8 or p.get("broadcast", {}).get("calls") for p in phases.values()):
        problems.append(f"only scalars and {flags} one-byte flags may be all-reduced, and nothing broadcast: {phases}")
    total = sum(p[c]["elements"] for p in step.values() for c in ("all_gather", "reduce_scatter"))
    return [f"[{name}] {p} (whole step: {total} elements, 3 Psi = {3 * psi(model)})" for p in problems]


# -- memory ---------------------------------------------------------------------------------------------------
def memory(rank: int, precision: str, threshold: int) -> dict:
    model = build("transformer")
    config = {**PARTITIONED, "param_persistence_threshold": threshold}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine = zero_core.setup(model, make_optimizer(model), config)
    one_step(engine, "transformer", rank, 0, DTYPES[precision])
    masters = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    return {"bytes": engine.memory_stats(), "step_counter_bytes": masters * FP32_BYTES}


def expected_memory(precision: str, threshold: int, world_size: int) -> dict[str, tuple[float, float]]:
    """(least, most) bytes per category: 16 Psi/N for AdamW (2+2+4+8 in bf16; the fp32 master is the shard
    itself in fp32), plus full copies of persistent units; 'most' allows one element of padding per unit."""
    model = build("transformer")
    units = expected_units(model, world_size, threshold)
    n, half = world_size, DTYPES[precision].itemsize
    shard, pad = psi(model) / n, len(units)
    persistent = sum(u["padded"] for u in units if u["persistent"])
    master = 0 if precision == "fp32" else FP32_BYTES
    return {"params": (half * (shard + persistent), half * (shard + pad + persistent)),
            "grads": (half * shard, half * (shard + pad)),
            "fp32_master": (master * shard, master * (shard + pad)),
            # one optimizer piece per parameter fragment: padding holds no state (up to n-1 elements per unit less)
            "optimizer_state": (ADAM_STATES * FP32_BYTES * (shard - pad * (n - 1)),
                                ADAM_STATES * FP32_BYTES * (shard + pad))}


def scratch_by_depth(rank: int) -> dict:
    """Scratch (buffers) bytes after one step of the same-width MLP at two depths: must not grow with depth. The
    reduction bucket holds reduce_bucket_size elements (or the whole model, when smaller): both depths exceed it."""
    found = {}
    for depth in (3, 9):
        model = WideMLP(depth=depth)
        engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "reduce_bucket_size": 1000})
        one_step(engine, "wide", rank, 0)
        found[depth] = engine.memory_stats()["buffers"]
    return found


# -- live parameters ------------------------------------------------------------------------------------------
def peak_live(rank: int, name: str, max_live: int) -> dict:
    model = build(name)
    engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "max_live_parameters": max_live})
    for step in range(3):
        one_step(engine, name, rank, step)
    return {"peak": engine.runtime.peak_live_elements,
            "module": max(module_gather_numel(model, m, dist_world()) for m in model.modules()),
            "whole": sum(u["padded"] for u in expected_units(model, dist_world()))}


def dist_world() -> int:
    return torch.distributed.get_world_size()


# -- behaviour ------------------------------------------------------------------------------------------------
def access_errors(rank: int) -> dict:
    """What each way of touching a partitioned parameter outside forward raises, and metadata reads."""
    model = build("transformer")
    zero_core.setup(model, make_optimizer(model), PARTITIONED)
    param = model.blocks[0].fc1.weight
    found = {}
    for label, touch in (("p.sum()", lambda: param.sum()), ("model.state_dict()", lambda: model.state_dict()),
                         ("p.data.clone()", lambda: param.data.clone())):
        try:
            touch()
            found[label] = "no error"
        except RuntimeError as error:
            found[label] = str(error)
    found["metadata"] = (tuple(param.shape), param.numel(), param.dtype, param.requires_grad)
    with zero_core.GatheredParameters(list(model.parameters())):
        found["state_dict inside GatheredParameters"] = sorted(model.state_dict())
    return found


def inference(rank: int) -> dict:
    """After each of 2 lockstep training steps: eval() under no_grad and inference_mode, and generation that
    calls submodules many times, against the DDP model; and what stays gathered afterwards."""
    ref = build("transformer")
    ref_optimizer, ddp = make_optimizer(ref), DistributedDataParallel(ref)
    model = build("transformer")
    engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "param_persistence_threshold": 100})
    persistent = sum(u["padded"] for u in expected_units(model, dist_world(), 100) if u["persistent"])
    worst, same_tokens, live = 0.0, True, {}
    for step in range(2):
        data = batch("transformer", rank, step, 0)
        ddp(*data).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        one_step(engine, "transformer", rank, step)
        held_out = batch("transformer", rank, 100 + step, 0)
        model.eval(), ref.eval()
        for mode, context in (("no_grad", torch.no_grad()), ("inference_mode", torch.inference_mode())):
            with context:
                worst = max(worst, (model(*held_out) - ref(*held_out)).abs().item())
            live[f"after {mode} forward, step {step}"] = engine.runtime.live_elements
        tokens, logits = generate(model, held_out[0][:, :3], 8)
        ref_tokens, ref_logits = generate(ref, held_out[0][:, :3], 8)
        same_tokens &= torch.equal(tokens, ref_tokens)
        worst = max(worst, (logits - ref_logits).abs().max().item())
        live[f"after generation, step {step}"] = engine.runtime.live_elements
        model.train(), ref.train()
    return {"worst": worst, "same_tokens": same_tokens, "live": live, "persistent": persistent}


def partition_cache(rank: int) -> dict:
    """Forward without backward leaves units gathered (reuse, a returned bias); empty_partition_cache() releases
    all but the persistent ones, and the step then finishes with the same weights as without emptying."""
    found = {}
    for name, threshold in (("transformer", 100), ("bias_returning", 0)):
        runs = [cache_run(rank, name, threshold, empty) for empty in (True, False)]
        found[name] = {**runs[0]["live"], "weights vs not emptying": max_abs_diff(runs[0]["w"], runs[1]["w"]),
                       "persistent": sum(u["padded"] for u in expected_units(build(name), dist_world(), threshold)
                                         if u["persistent"])}
    return found


def cache_run(rank: int, name: str, threshold: int, empty: bool) -> dict:
    model = build(name)
    engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "param_persistence_threshold": threshold})
    for step in range(2):
        one_step(engine, name, rank, step)
    loss = model(*batch(name, rank, 2, 0))
    live = {"before": engine.runtime.live_elements}
    if empty:
        engine.empty_partition_cache()
    live["after"] = engine.runtime.live_elements
    engine.backward(loss)
    engine.step()
    live["after step"] = engine.runtime.live_elements
    return {"live": live, "w": full_params(model)}


def bf16_training(rank: int) -> list[float]:
    model = build("transformer")
    engine = zero_core.setup(model, make_optimizer(model), {**PARTITIONED, "bf16": {"enabled": True}})
    losses = []
    for step in range(12):
        loss = model(*batch("transformer", 0, step % 2, 0, torch.bfloat16))  # two batches, seen again and again
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def worker(rank, world_size):
    """Accounting at every world size; behaviour at 2 ranks only (4 ranks on this 2-core machine are slow)."""
    sections = {f"comm {name}": (communication, rank, name) for name in ("wide", "transformer")}
    sections.update({f"memory {p} {t}": (memory, rank, p, t) for p, t in (("fp32", 0), ("bf16", 0), ("fp32", 100))})
    sections.update({f"live {n} {m}": (peak_live, rank, n, m) for n, m in LIVE_BUDGETS})
    if world_size == 2:
        sections.update({"scratch": (scratch_by_depth, rank), "access": (access_errors, rank),
                         "inference": (inference, rank), "cache": (partition_cache, rank),
                         "bf16": (bf16_training, rank)})
    return {key: capture(fn, *args) for key, (fn, *args) in sections.items()}


def results(world_size: int) -> list[dict]:
    return run_once(worker, world_size, timeout=300)


def sections(world_size: int, key: str) -> list:
    return [unwrap(result[key]) for result in results(world_size)]


WORLD_SIZES = pytest.mark.parametrize("world_size", [2, 4])
BEHAVIOUR_WORLD_SIZES = pytest.mark.parametrize("world_size", [2])


@pytest.mark.timeout(400)
@WORLD_SIZES
def test_communication_per_step_is_three_psi(world_size):
    """all-gather Psi in forward and Psi in backward, reduce-scatter Psi: 3 Psi per step within padding (less where
    a root group, gathered once, stays gathered from the forward into the backward)."""
    problems = []
    for name in ("wide", "transformer"):
        for rank, phases in enumerate(sections(world_size, f"comm {name}")):
            problems += [f"rank {rank} {p}" for p in check_communication(name, world_size, phases)]
        rank_0 = sections(world_size, f"comm {name}")[0]
        print(f"N={world_size} {name} (Psi={psi(build(name))}) elements per phase on rank 0: " + ", ".join(
            f"{phase} {c}={counts[c]['elements']}" for phase, counts in rank_0.items()
            for c in ("all_gather", "reduce_scatter") if counts[c]["calls"]))
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(400)
@WORLD_SIZES
def test_model_state_bytes_follow_sixteen_psi_over_n(world_size):
    problems, report = [], []
    for precision, threshold in (("fp32", 0), ("bf16", 0), ("fp32", 100)):
        expected = expected_memory(precision, threshold, world_size)
        for rank, found in enumerate(sections(world_size, f"memory {precision} {threshold}")):
            measured = found["bytes"]
            report.append(f"N={world_size} rank {rank} {precision} persistence<{threshold}: {measured}")
            for category, (least, most) in expected.items():
                most += found["step_counter_bytes"] if category == "optimizer_state" else 0
                if not least <= measured[category] <= most:
                    problems.append(f"rank {rank} {precision} threshold {threshold}: {category} = "
                                    f"{measured[category]} bytes, expected {least:.0f}..{most:.0f}")
    print("\n".join(report))
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_scratch_buffers_do_not_grow_with_depth(world_size):
    for rank, found in enumerate(sections(world_size, "scratch")):
        assert found[3] == found[9], f"rank {rank}: scratch bytes by depth {found}"


@pytest.mark.timeout(400)
@WORLD_SIZES
def test_gathered_parameters_stay_within_max_live_plus_one_module(world_size):
    """One module: one hooked module, a whole block for the blocks of a ModuleList (docs/stage3.md)."""
    problems = []
    for name, max_live in LIVE_BUDGETS:
        measured = sections(world_size, f"live {name} {max_live}")
        print(f"N={world_size} {name} max_live_parameters={max_live}: {measured}")
        for rank, found in enumerate(measured):
            if not found["peak"] <= max_live + found["module"]:
                problems.append(f"rank {rank} {name}: peak {found['peak']} gathered elements > max_live_parameters "
                                f"{max_live} + largest module {found['module']} (whole model {found['whole']})")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_partitioned_access_raises_an_error_naming_the_parameter(world_size):
    for rank, found in enumerate(sections(world_size, "access")):
        for label in ("p.sum()", "model.state_dict()", "p.data.clone()"):
            message = found[label]
            named = "blocks.0.fc1.weight" in message or (label == "model.state_dict()" and "tok.weight" in message)
            assert named and "GatheredParameters" in message, f"rank {rank} {label}: {message}"
        assert found["metadata"] == ((45, 22), 990, torch.float32, True), f"rank {rank}: {found['metadata']}"
        assert "blocks.0.fc1.weight" in found["state_dict inside GatheredParameters"]


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_eval_no_grad_inference_mode_and_generation_match_ddp(world_size):
    for rank, found in enumerate(sections(world_size, "inference")):
        assert found["worst"] <= 1e-5 and found["same_tokens"], f"rank {rank}: {found}"


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_nothing_but_persistent_units_stays_gathered_after_inference(world_size):
    """No backward follows a forward under no_grad or inference_mode: keeping units for reuse would hold the
    whole model gathered after evaluation (max_reuse_distance's default is 1e9)."""
    for rank, found in enumerate(sections(world_size, "inference")):
        leaked = {when: live for when, live in found["live"].items() if live != found["persistent"]}
        assert not leaked, f"rank {rank}: gathered elements {leaked}, persistent units hold {found['persistent']}"


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_empty_partition_cache_keeps_only_persistent_units(world_size):
    for rank, found in enumerate(sections(world_size, "cache")):
        for name, live in found.items():
            assert live["before"] > live["persistent"], f"rank {rank} {name}: nothing was cached to empty: {live}"
            assert live["after"] == live["persistent"] == live["after step"], f"rank {rank} {name}: {live}"
            assert live["weights vs not emptying"] <= 1e-7, f"rank {rank} {name}: {live}"


@pytest.mark.timeout(400)
@BEHAVIOUR_WORLD_SIZES
def test_bf16_stage3_trains(world_size):
    for rank, losses in enumerate(sections(world_size, "bf16")):
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), f"rank {rank}: loss did not fall: {losses}"


# -- ranks that take different code paths ---------------------------------------------------------------------
def diverge(rank: int, routes, check_collectives: bool = False):
    """Train the routed model, rank r taking ``routes(rank, step)``; the error each rank gets, or None."""
    if check_collectives:
        os.environ["ZERO_CORE_CHECK_COLLECTIVES"] = "1"  # read when the engine is built
    try:
        model = build("routed")
        engine = zero_core.setup(model, make_optimizer(model), PARTITIONED)
        for step in range(4):
            x, y, _ = batch("routed", rank, step, 0)
            engine.backward(model(x, y, routes(rank, step)))
            engine.step()
        return None
    except RuntimeError as error:
        return str(error)
    finally:
        os.environ.pop("ZERO_CORE_CHECK_COLLECTIVES", None)


def swapped_on_rank_1(at_step: int):
    return lambda rank, step: (0, 2, 1) if rank == 1 and step == at_step else (0, 1, 2)


def extra_on_rank_1(rank, step):
    return (0, 1, 2, 1) if rank == 1 and step == 0 else (0, 1, 2)


def divergence_worker(rank, world_size):
    return {"first step, order": capture(diverge, rank, swapped_on_rank_1(0)),
            "first step, extra module": capture(diverge, rank, extra_on_rank_1),
            "step 3, ZERO_CORE_CHECK_COLLECTIVES=1": capture(diverge, rank, swapped_on_rank_1(3), True)}


@pytest.mark.timeout(300)
def test_ranks_taking_different_module_orders_get_an_error_not_a_hang():
    """Every rank raises (the harness turns a hang into a TimeoutError) an error that names modules: in the
    first step the two that differ; later, with the collective check on, the collectives that differ."""
    problems = []
    for rank, found in enumerate(run_distributed(divergence_worker, 2, timeout=150)):
        for scenario, section in found.items():
            message = unwrap(section)
            names = ("layers.1", "layers.2") if scenario == "first step, order" else ("layers.", "out")
            if message is None or not any(f"'{name}" in message for name in names) or "rank" not in message:
                problems.append(f"rank {rank} [{scenario}]: expected an error naming {names}, got {message!r}")
    assert not problems, "\n".join(problems)
