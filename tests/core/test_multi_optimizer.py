"""Several optimizers on one engine (a generator's and a discriminator's), against one process on the whole batch.

Each step runs the usual GAN sequence: the generator's loss, backward, clip and step of the generator's
optimizer only; then the discriminator's. "toggle" freezes the other network's parameters (requires_grad=False)
as Lightning's toggle_optimizer does; without it, the generator's backward also leaves gradients on the
discriminator, which its own backward then adds to, as in plain torch; "no_sync" runs every backward under
engine.no_sync(), so each step reduces what its own optimizer holds. The reference is plain torch in one
process over the ranks' batches put together (mean losses, so its gradients are the ranks' average). One spawn
runs every case; checkpoints saved with two optimizers are resumed at another world size and stage, exported as
plain state dicts, and a second set of optimizers replaces the first (a second fit).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_core
from distributed import run_distributed
from models import GAN_DATA, GAN_NOISE, GanPair, discriminator_loss, generator_loss
from stage3_support import capture, full_params, max_abs_diff, unwrap

WORLD = 2
STEPS = 3
MAX_NORM = 0.05  # small enough that the generator's gradients are really clipped
TOLERANCE = 1e-5
# (stage, toggle, every backward under no_sync: then each optimizer's step reduces only its own parameters)
CASES = [(stage, toggle, False) for stage in (1, 2, 3) for toggle in (True, False)] + \
    [(stage, False, True) for stage in (2, 3)]


def make_optimizers(model: GanPair) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    generator = torch.optim.Adam(model.generator.parameters(), lr=1e-2, betas=(0.5, 0.9))
    discriminator = torch.optim.SGD([{"params": [model.discriminator[0].weight], "weight_decay": 0.1},
                                     {"params": [model.discriminator[0].bias, *model.discriminator[2].parameters()]}],
                                    lr=5e-2, momentum=0.9)
    return generator, discriminator


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, GAN_NOISE, generator=gen), torch.randn(4, GAN_DATA, generator=gen) + 1.0


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(rank, step) for rank in range(WORLD)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def set_trainable(module: nn.Module, flag: bool) -> None:
    for param in module.parameters():
        param.requires_grad_(flag)


def gan_step(model, optimizers, backward, clip, noise, real, toggle: bool) -> float:
    """One generator step then one discriminator step; returns the generator's norm before clipping. The
    networks are called directly (no root forward): stage 3 then ends its trace at each step."""
    opt_g, opt_d = optimizers
    gen, disc = model.generator, model.discriminator
    if toggle:
        set_trainable(disc, False)
    backward(generator_loss(gen, disc, noise))
    norm = float(clip())
    opt_g.step()
    opt_g.zero_grad()
    if toggle:
        set_trainable(disc, True)
        set_trainable(gen, False)
    backward(discriminator_loss(gen, disc, noise, real))
    opt_d.step()
    opt_d.zero_grad()
    if toggle:
        set_trainable(gen, True)
    return norm


def train_reference(toggle: bool, steps: range, model=None, optimizers=None) -> tuple:
    """Plain torch over both ranks' batches; fresh optimizers unless given. Returns (model, optimizers, norms)."""
    model = model or GanPair()
    optimizers = optimizers or make_optimizers(model)
    norms = []
    for step in steps:
        clip = lambda: nn.utils.clip_grad_norm_(model.generator.parameters(), MAX_NORM)  # noqa: E731
        norms.append(gan_step(model, optimizers, lambda loss: loss.backward(), clip, *whole_batch(step), toggle))
    return model, optimizers, norms


def train_engine(engine, toggle: bool, steps: range, unsynced: bool = False) -> list[float]:
    rank = dist.get_rank()
    clip = lambda: engine.clip_grad_norm_(MAX_NORM, optimizer=0)  # noqa: E731

    def backward(loss):
        with engine.no_sync() if unsynced else contextlib.nullcontext():
            engine.backward(loss)

    return [gan_step(engine.module, engine.optimizers, backward, clip, *batch(rank, step), toggle)
            for step in steps]


def setup(stage: int, seed: int = 0):
    model = GanPair(seed)
    config = {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300,
              "param_persistence_threshold": 0}
    return zero_core.setup(model, list(make_optimizers(model)), config)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- the sections ------------------------------------------------------------------------------------------
def parity(stage: int, toggle: bool, unsynced: bool) -> dict:
    engine = setup(stage)
    norms = train_engine(engine, toggle, range(STEPS), unsynced)
    model, _, expected_norms = train_reference(toggle, range(STEPS))
    return {"diff": max_abs_diff(full_params(engine.module), snapshot(model)),
            "norm_diff": max(abs(a - b) for a, b in zip(norms, expected_norms)),
            "clipped": min(expected_norms) > MAX_NORM}


def resume_elsewhere(directory: Path, stage: int) -> dict:
    """Save two optimizers at world size 2, resume at world size 1 with another stage, against the reference."""
    from zero_core.checkpoint import export_optimizer_state, save_checkpoint

    engine = setup(stage)
    train_engine(engine, True, range(2))
    save_checkpoint(engine, directory)
    if dist.get_rank() == 0:
        export_optimizer_state(directory, directory.parent / f"plain-{stage}.pt")
    dist.barrier()
    return {}


def replace(stage: int) -> dict:
    """A second set of optimizers (a second fit): training goes on from the same weights with fresh state."""
    engine = setup(stage)
    train_engine(engine, True, range(2))
    engine.replace_optimizers(list(make_optimizers(engine.module)))
    train_engine(engine, True, range(2, 4))
    model, _, _ = train_reference(True, range(2))
    train_reference(True, range(2, 4), model)  # fresh optimizers, as replace_optimizers
    errors = {}
    try:
        engine.replace_optimizers(torch.optim.SGD(engine.module.parameters(), lr=0.1))
    except ValueError as error:
        errors["regrouped"] = str(error)
    return {"diff": max_abs_diff(full_params(engine.module), snapshot(model)), **errors}


def misuse() -> dict:
    model = GanPair()
    errors = {}
    try:
        zero_core.setup(model, [torch.optim.SGD(model.parameters(), lr=0.1),
                                torch.optim.SGD(model.generator.parameters(), lr=0.1)], {"stage": 2})
    except ValueError as error:
        errors["shared_param"] = str(error)
    model = GanPair()
    engine = zero_core.setup(model, list(make_optimizers(model)), {"stage": 2})
    try:
        engine.optimizer
    except RuntimeError as error:
        errors["optimizer"] = str(error)
    try:
        engine.clip_grad_norm_(1.0, optimizer=torch.optim.SGD(GanPair().parameters(), lr=0.1))
    except ValueError as error:
        errors["foreign"] = str(error)
    return errors


def fp16_overflow_in_one_optimizer() -> dict:
    """fp16, no toggling: the generator's gradients overflow at step 1 while the discriminator's (made with the
    same scale by the same backward) do not. The generator's step is skipped on every rank; the scale may only
    drop after the discriminator stepped, or its update would be unscaled by the wrong scale."""
    model = GanPair()
    sgd = [torch.optim.SGD(model.generator.parameters(), lr=0.1), torch.optim.SGD(model.discriminator.parameters(), lr=0.1)]
    fp16 = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 1}
    engine = zero_core.setup(model, sgd, {"stage": 2, "fp16": fp16})
    rank, disc = dist.get_rank(), model.discriminator
    masters = lambda: {n: zero_core.safe_get_full_fp32_param(p) for n, p in disc.named_parameters()}  # noqa: E731
    scales, deltas = [], []
    for step in range(2):
        noise, real = (t.half() for t in batch(rank, step))
        before = masters()
        penalty = 1e5 * model.generator[0].weight.float().sum() if step == 1 else 0.0  # only the generator's
        engine.backward(generator_loss(model.generator, disc, noise) + penalty)
        engine.optimizers[0].step()
        scales.append(engine.loss_scale)
        engine.backward(discriminator_loss(model.generator, disc, noise, real))
        engine.optimizers[1].step()
        scales.append(engine.loss_scale)
        after = masters()
        deltas.append({n: (after[n] - before[n]) for n in after})
    # the reference: fp32, both ranks' batches, the generator's step 1 skipped (its gradients dropped)
    ref = GanPair()
    ref_sgd = [torch.optim.SGD(ref.generator.parameters(), lr=0.1), torch.optim.SGD(ref.discriminator.parameters(), lr=0.1)]
    ref_deltas = []
    for step in range(2):
        noise, real = whole_batch(step)
        before = {n: p.detach().clone() for n, p in ref.discriminator.named_parameters()}
        generator_loss(ref.generator, ref.discriminator, noise).backward()
        if step == 0:
            ref_sgd[0].step()
        ref_sgd[0].zero_grad()
        discriminator_loss(ref.generator, ref.discriminator, noise, real).backward()
        ref_sgd[1].step()
        ref_sgd[1].zero_grad()
        ref_deltas.append({n: p.detach() - before[n] for n, p in ref.discriminator.named_parameters()})
    ratio = [sum(d[n].norm() ** 2 for n in d).sqrt().item() / sum(r[n].norm() ** 2 for n in r).sqrt().item()
             for d, r in zip(deltas, ref_deltas)]
    return {"scales": scales, "skipped": engine.skipped_steps, "ratio": ratio}


def worker(rank: int, world_size: int, directory: str) -> dict:
    out = {f"parity-{case}": capture(parity, *case) for case in CASES}
    for stage in (2, 3):
        out[f"save-{stage}"] = capture(resume_elsewhere, Path(directory) / f"ckpt-{stage}", stage)
    out["replace-3"] = capture(replace, 3)
    out["replace-1"] = capture(replace, 1)
    out["misuse"] = capture(misuse)
    out["fp16"] = capture(fp16_overflow_in_one_optimizer)
    return out


def resume_worker(rank: int, world_size: int, directory: str) -> dict:
    """World size 1, stage 1: load the two-optimizer checkpoints and train on."""
    return {f"resume-{stage}": capture(resume, Path(directory), stage) for stage in (2, 3)}


def resume(directory: Path, stage: int) -> dict:
    from zero_core.checkpoint import load_checkpoint

    engine = setup(1, seed=7)
    load_checkpoint(engine, directory / f"ckpt-{stage}")
    clip = lambda: engine.clip_grad_norm_(MAX_NORM, optimizer=0)  # noqa: E731
    for step in range(2, 4):  # this single rank sees both ranks' batches, as the reference does
        gan_step(engine.module, engine.optimizers, engine.backward, clip, *whole_batch(step), True)
    model, optimizers, _ = train_reference(True, range(2))
    exported = _compare_exported(torch.load(directory / f"plain-{stage}.pt", weights_only=True), optimizers)
    train_reference(True, range(2, 4), model, optimizers)
    return {"classes": [type(o).__name__ for o in engine.inner_optimizers], "exported": exported,
            "diff": max_abs_diff(full_params(engine.module), snapshot(model))}


def _compare_exported(plain, optimizers) -> float:
    """Largest difference between the exported plain state dicts and the reference optimizers' own."""
    if not isinstance(plain, list) or len(plain) != 2:
        return float("inf")
    worst = 0.0
    for exported, optimizer in zip(plain, optimizers):
        expected = optimizer.state_dict()
        if len(exported["param_groups"]) != len(expected["param_groups"]):
            return float("inf")
        for param_id, state in expected["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    worst = max(worst, (exported["state"][param_id][key] - value).abs().max().item())
    return worst


# -- the tests -------------------------------------------------------------------------------------------
_RESULTS: dict = {}


def results(tmp_path_factory) -> dict:
    if "main" not in _RESULTS:
        root = tmp_path_factory.mktemp("multi_optimizer")
        _RESULTS["main"] = run_distributed(worker, WORLD, str(root), timeout=300)
        _RESULTS["resume"] = run_distributed(resume_worker, 1, str(root), timeout=120)
    return _RESULTS


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}{'-toggle' * c[1]}{'-no_sync' * c[2]}")
def test_two_optimizers_match_one_process(tmp_path_factory, case):
    for rank_result in results(tmp_path_factory)["main"]:
        found = unwrap(rank_result[f"parity-{case}"])
        assert found["clipped"], "the test's max norm no longer clips: lower MAX_NORM"
        assert found["diff"] <= TOLERANCE, f"weights differ from the reference by {found['diff']}"
        assert found["norm_diff"] <= 1e-5, f"the generator's gradient norm differs by {found['norm_diff']}"


@pytest.mark.parametrize("stage", [2, 3])
def test_two_optimizer_checkpoint_resumes_at_another_world_size_and_exports(tmp_path_factory, stage):
    found = results(tmp_path_factory)
    for rank_result in found["main"]:
        unwrap(rank_result[f"save-{stage}"])
    resumed = unwrap(found["resume"][0][f"resume-{stage}"])
    assert resumed["classes"] == ["Adam", "SGD"]
    assert resumed["diff"] <= TOLERANCE, f"the resumed run differs from the reference by {resumed['diff']}"
    assert resumed["exported"] <= 1e-6, f"the exported optimizer states differ by {resumed['exported']}"


@pytest.mark.parametrize("stage", [1, 3])
def test_replacing_optimizers_trains_on_like_fresh_torch_optimizers(tmp_path_factory, stage):
    for rank_result in results(tmp_path_factory)["main"]:
        found = unwrap(rank_result[f"replace-{stage}"])
        assert found["diff"] <= TOLERANCE, f"differs from the reference by {found['diff']}"
        assert "group the trainable parameters differently" in found["regrouped"]


def test_misuse_of_several_optimizers_is_named(tmp_path_factory):
    errors = unwrap(results(tmp_path_factory)["main"][0]["misuse"])
    assert "'generator.0.weight' is in two optimizer groups" in errors["shared_param"]
    assert "engine.optimizers[k]" in errors["optimizer"]
    assert "not one of this engine's optimizers" in errors["foreign"]


def test_fp16_scale_waits_for_every_optimizer_and_overflow_skips_only_its_own(tmp_path_factory):
    for rank_result in results(tmp_path_factory)["main"]:
        found = unwrap(rank_result["fp16"])
        assert found["skipped"] == 1  # the generator's step 1, on every rank
        # (generator, discriminator) after each step: the drop waits until the discriminator has stepped
        assert found["scales"] == [4096.0, 4096.0, 4096.0, 2048.0]
        for ratio in found["ratio"]:  # the discriminator's update as in fp32 (a wrong unscale gives 2.0)
            assert ratio == pytest.approx(1.0, abs=0.02)
