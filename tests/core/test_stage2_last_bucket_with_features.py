"""Adversarial checks of stage 2's last bucket (zero_core/replicated/last_bucket.py) against references: one
process averaging every rank's loss with torch's own optimizers, or the same engine at stage 1 (whose reduction
this change leaves alone). Cases: two optimizers where the last bucket (the model's first layer, which backward
reaches last) belongs to the second one, stepping separately under Lightning's toggle_optimizer pattern; several
buckets with overlap_comm and no_sync; the optimizer offloaded to the CPU with accumulation and clipping (fp32 and
bf16); reduce_scatter: false; fp16 with an overflow on one rank; engine.join() with uneven inputs; a checkpoint
saved between micro-batches; add_param_group after setup, and a frozen layer unfrozen (before the first step
too: a new reducer whose last bucket is another bucket than the old one, while the old one's local gradients
wait); three ranks."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_core
from distributed import run_distributed

STEPS = 3
TOL = 1e-5


def _model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _batch(rank: int, step: int, micro: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 6, generator=g).to(dtype)


def _loss(model, x, which: int = 0) -> torch.Tensor:
    out = model(x).float()
    return out.square().mean() if which == 0 else (out - 1).abs().mean()


def _set(params, flag: bool) -> None:
    for p in params:
        p.requires_grad_(flag)


def _diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def _two_optimizers(model):
    """The second optimizer owns the first layer: the bucket backward reaches last (position 0)."""
    rest = [*model[2].parameters(), *model[4].parameters()]
    first = list(model[0].parameters())
    return [torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(first, lr=5e-2, weight_decay=0.05)], \
        rest, first


def _gan_like(model, opts, rest, first, backward_of, clip, rank, world, step, toggle: bool, order=(0, 1)) -> None:
    """Each optimizer in turn: (toggle) backward, clip, step, zero_grad."""
    groups = [rest, first]
    for k in order:
        if toggle:
            _set(groups[1 - k], False)
        backward_of(lambda x: _loss(model, x, k), step, k)
        clip(k)
        opts[k].step()
        opts[k].zero_grad()
        if toggle:
            _set(groups[1 - k], True)


def _reference_two(rank, world, toggle, order, clip_norm):
    model = _model()
    opts, rest, first = _two_optimizers(model)
    groups = [rest, first]

    def backward_of(loss_fn, step, k):
        total = sum(loss_fn(_batch(r, step, k)) for r in range(world)) / world
        total.backward()

    def clip(k):
        if clip_norm:
            torch.nn.utils.clip_grad_norm_([p for p in groups[k] if p.grad is not None], clip_norm)

    for step in range(STEPS):
        _gan_like(model, opts, rest, first, backward_of, clip, rank, world, step, toggle, order)
    return model


def _engine_two(rank, world, toggle, order, clip_norm, config):
    model = _model()
    opts, rest, first = _two_optimizers(model)
    engine = zero_core.setup(model, opts, config)

    def backward_of(loss_fn, step, k):
        engine.backward(loss_fn(_batch(rank, step, k)))

    def clip(k):
        if clip_norm:
            engine.clip_grad_norm_(clip_norm, optimizer=k)

    for step in range(STEPS):
        _gan_like(model, engine.optimizers, rest, first, backward_of, clip, rank, world, step, toggle, order)
    engine.close()
    return model


def _two_optimizer_probes(rank: int, world: int) -> dict:
    out = {}
    for toggle in (True, False):
        for order in ((0, 1), (1, 0)):
            for buckets in ("one", "many"):
                config = {"stage": 2, "ignore_unused_parameters": True}
                if buckets == "many":
                    config.update(reduce_bucket_size=24, overlap_comm=True)
                ref = _reference_two(rank, world, toggle, order, 0.05)
                got = _engine_two(rank, world, toggle, order, 0.05, config)
                out[f"toggle={toggle} order={order} {buckets}"] = _diff(ref, got)
    return out


@pytest.mark.timeout(120)
def test_two_optimizers_last_bucket_in_the_second():
    for result in run_distributed(_two_optimizer_probes, 2, timeout=100):
        assert all(v < TOL for v in result.values()), result


# -- one optimizer: accumulation, no_sync, clipping, offload, reduce_scatter, several buckets -------------------

def _accumulate(model, backward, no_sync, rank, world, micro_batches: int, unsynced: bool, dtype, clip, step_fn,
                zero_model_grad: bool = False, save=None):
    for step in range(STEPS):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            ctx = no_sync() if (unsynced and not last and no_sync is not None) else contextlib.nullcontext()
            with ctx:
                backward(rank, step, micro)
            if save is not None and step == 1 and micro == 0:
                save()
        clip()
        step_fn()
        if zero_model_grad:
            model.zero_grad()  # Hugging Face's Trainer does this after each step


def _reference_accumulate(world, micro_batches, clip_norm, dtype=torch.float32):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def backward(rank, step, micro):
        (sum(_loss(model, _batch(r, step, micro)) for r in range(world)) / world).backward()

    def clip():
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)

    def step_fn():
        opt.step()
        opt.zero_grad()

    _accumulate(model, backward, None, 0, world, micro_batches, False, dtype, clip, step_fn)
    return model


def _engine_accumulate(rank, world, micro_batches, unsynced, clip_norm, config, dtype=torch.float32,
                       zero_model_grad=False, save_dir=None, use_config_clip=False):
    model = _model(dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if use_config_clip:
        config = dict(config, gradient_clipping=clip_norm)
    engine = zero_core.setup(model, opt, config)

    def backward(rank, step, micro):
        engine.backward(_loss(model, _batch(rank, step, micro, dtype)))

    def clip():
        if clip_norm and not use_config_clip:
            engine.clip_grad_norm_(clip_norm)

    def step_fn():
        engine.step()
        engine.zero_grad()

    save = (lambda: engine.save_checkpoint(save_dir)) if save_dir else None
    _accumulate(model, backward, engine.no_sync, rank, world, micro_batches, unsynced, dtype, clip, step_fn,
                zero_model_grad, save)
    engine.close()
    return model


ACCUMULATION_CONFIGS = {
    "plain": {"stage": 2},
    "many_overlap": {"stage": 2, "reduce_bucket_size": 24, "overlap_comm": True},
    "many_no_overlap": {"stage": 2, "reduce_bucket_size": 24, "overlap_comm": False},
    "offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "offload_many": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 24},
    "no_reduce_scatter": {"stage": 2, "reduce_scatter": False},
    "no_reduce_scatter_many": {"stage": 2, "reduce_scatter": False, "reduce_bucket_size": 24,
                               "overlap_comm": True},
}
THREE_RANK_CONFIGS = ("plain", "many_overlap", "offload", "no_reduce_scatter")


def _accumulation_probes(rank: int, world: int, directory: str) -> dict:
    out = {}
    ref = {clip: _reference_accumulate(world, 3, clip) for clip in (0.0, 0.05)}
    configs = ACCUMULATION_CONFIGS
    for name, config in configs.items():
        for unsynced in (False, True):
            for clip in (0.0, 0.05):
                got = _engine_accumulate(rank, world, 3, unsynced, clip, config)
                out[f"{name} unsynced={unsynced} clip={clip}"] = _diff(ref[clip], got)
            got = _engine_accumulate(rank, world, 3, unsynced, 0.05, config, use_config_clip=True,
                                     zero_model_grad=True)
            out[f"{name} unsynced={unsynced} config_clip+model.zero_grad"] = _diff(ref[0.05], got)
    # a checkpoint saved between micro-batches must not disturb the accumulation
    for unsynced in (False, True):
        got = _engine_accumulate(rank, world, 3, unsynced, 0.05, {"stage": 2, "reduce_bucket_size": 24},
                                 save_dir=f"{directory}/ckpt-{unsynced}")
        out[f"checkpoint mid-accumulation unsynced={unsynced}"] = _diff(ref[0.05], got)
    return out


@pytest.mark.timeout(150)
def test_accumulation_variants_match_one_process(tmp_path):
    for result in run_distributed(_accumulation_probes, 2, str(tmp_path), timeout=130):
        assert all(v < TOL for v in result.values()), result


def _three_ranks(rank: int, world: int, directory: str) -> dict:
    out = {}
    ref = _reference_accumulate(world, 2, 0.05)
    for name in THREE_RANK_CONFIGS:
        config = ACCUMULATION_CONFIGS[name]
        for unsynced in (False, True):
            got = _engine_accumulate(rank, world, 2, unsynced, 0.05, config)
            out[f"{name} unsynced={unsynced}"] = _diff(ref, got)
    out.update({f"w3 {k}": v for k, v in _two_optimizer_probes(rank, world).items() if "many" in k})
    return out


@pytest.mark.timeout(150)
def test_three_ranks(tmp_path):
    for result in run_distributed(_three_ranks, 3, str(tmp_path), timeout=130):
        assert all(v < TOL for v in result.values()), result


# -- against stage 1: bf16 offload, fp16 overflow, join ----------------------------------------------------------

def _stage_pair(rank: int, world: int, directory: str) -> dict:
    out = {}
    # bf16 with the optimizer offloaded: the gradient shards are copied to the host at each reduction
    for name, config in {"bf16_offload": {"bf16": {"enabled": True}, "offload_optimizer": {"device": "cpu"}},
                         "bf16_offload_many": {"bf16": {"enabled": True}, "offload_optimizer": {"device": "cpu"},
                                               "reduce_bucket_size": 24, "overlap_comm": True},
                         "bf16": {"bf16": {"enabled": True}},
                         "bf16_many": {"bf16": {"enabled": True}, "reduce_bucket_size": 24, "overlap_comm": True}}.items():
        for unsynced in (False, True):
            models = [_engine_accumulate(rank, world, 3, unsynced, 0.05, dict(config, stage=s), dtype=torch.bfloat16)
                      for s in (1, 2)]
            out[f"{name} unsynced={unsynced}"] = _diff(*models)
    # fp16 with an overflow on rank 1 (in the first layer: the last bucket) at step 1
    for name, config in {"fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
                         "fp16_many": {"fp16": {"enabled": True, "initial_scale_power": 8}, "reduce_bucket_size": 24},
                         "fp16_offload": {"fp16": {"enabled": True, "initial_scale_power": 8},
                                          "offload_optimizer": {"device": "cpu"}}}.items():
        results = []
        for stage in (1, 2):
            model = _model(dtype=torch.float16)
            engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), dict(config, stage=stage))
            for step in range(4):
                for micro in range(2):
                    x = _batch(rank, step, micro, torch.float16)
                    if step == 1 and micro == 1 and rank == 1:
                        x[0, 0] = float("inf")
                    with engine.no_sync() if micro == 0 else contextlib.nullcontext():
                        engine.backward(model(x).float().square().mean() * 1e-3)
                engine.clip_grad_norm_(1.0)
                engine.step()
                engine.zero_grad()
            results.append((model, engine.skipped_steps))
            engine.close()
        out[f"{name}"] = _diff(results[0][0], results[1][0])
        out[f"{name} skipped"] = (results[0][1], results[1][1])
    # join: rank 1 runs out of batches one step early
    for name, config in {"join": {}, "join_many": {"reduce_bucket_size": 24, "overlap_comm": True}}.items():
        models = []
        for stage in (1, 2):
            model = _model()
            engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     dict(config, stage=stage))
            with engine.join():
                for step in range(STEPS + (1 if rank == 0 else 0)):
                    engine.backward(_loss(model, _batch(rank, step, 0)))
                    engine.step()
                    engine.zero_grad()
            models.append(model)
            engine.close()
        out[name] = _diff(*models)
    return out


@pytest.mark.timeout(150)
def test_stage2_matches_stage1_bf16_fp16_join(tmp_path):
    for result in run_distributed(_stage_pair, 2, str(tmp_path), timeout=130):
        for key, value in result.items():
            if key.endswith("skipped"):
                assert value[0] == value[1] == 1, (key, result)
            else:
                assert value < (1e-2 if "16" in key else TOL), (key, result)


# -- a parameter made trainable between micro-batches: a new reducer takes over with gradients waiting --------------

def _unfreeze_run(rank, world, schedule: str, layer: int, unsynced: bool, clip: float, config, zero: bool,
                  at_step: int = 1):
    model = _model()
    target = list(model[layer].parameters())
    _set(target, False)
    in_groups = schedule == "unfreeze"
    params = [p for p in model.parameters() if in_groups or all(p is not q for q in target)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    engine = zero_core.setup(model, opt, config) if zero else None
    for step in range(STEPS):
        for micro in range(2):
            if step == at_step and micro == 1:
                _set(target, True)
                if schedule == "add-group":
                    group = {"params": target, "lr": 5e-3}
                    engine.add_param_group(0, group) if zero else opt.add_param_group(group)
            if zero:
                ctx = engine.no_sync() if unsynced and micro == 0 else contextlib.nullcontext()
                with ctx:
                    engine.backward(_loss(model, _batch(rank, step, micro)))
            else:
                (sum(_loss(model, _batch(r, step, micro)) for r in range(world)) / world).backward()
        if zero:
            if clip:
                engine.clip_grad_norm_(clip)
            engine.step()
            engine.zero_grad()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
            opt.step()
            opt.zero_grad()
    if zero:
        engine.close()
    return model


def _unfreeze_probes(rank: int, world: int) -> dict:
    out = {}
    for schedule in ("unfreeze", "add-group"):
        for layer in (0, 2, 4):
            for unsynced in (False, True):
                for name, config in {"one": {"stage": 2}, "many": {"stage": 2, "reduce_bucket_size": 24}}.items():
                    for at_step in (0, 1):  # 0: before the first step (no zero_grad yet)
                        clip = 0.05
                        ref = _unfreeze_run(rank, world, schedule, layer, unsynced, clip, config, False, at_step)
                        got = _unfreeze_run(rank, world, schedule, layer, unsynced, clip, config, True, at_step)
                        out[f"{schedule} layer={layer} unsynced={unsynced} {name} at_step={at_step}"] = _diff(ref, got)
    return out


@pytest.mark.timeout(120)
def test_unfrozen_between_micro_batches():
    for result in run_distributed(_unfreeze_probes, 2, timeout=100):
        assert all(v < TOL for v in result.values()), result


# -- checkpoints: loaded between micro-batches, and resumed on a fresh engine ----------------------------------

def _checkpoint_run(rank, world, directory, config, unsynced: bool, mode: str):
    """mode: "none"; "load-mid" (save after step 0, load into the same engine between step 1's micro-batches);
    "resume" (save after step 1, continue on a fresh model and engine)."""
    model = _model()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
    for step in range(STEPS):
        if mode == "resume" and step == 2:
            engine.save_checkpoint(f"{directory}/resume")
            engine.close()
            model = _model(seed=5)
            engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
            engine.load_checkpoint(f"{directory}/resume")
        for micro in range(2):
            with engine.no_sync() if unsynced and micro == 0 else contextlib.nullcontext():
                engine.backward(_loss(model, _batch(rank, step, micro)))
            if mode == "load-mid" and step == 1 and micro == 0:
                engine.load_checkpoint(f"{directory}/mid")
        engine.clip_grad_norm_(0.05)
        engine.step()
        engine.zero_grad()
        if mode == "load-mid" and step == 0:
            engine.save_checkpoint(f"{directory}/mid")
    engine.close()
    return model


def _checkpoint_probes(rank: int, world: int, directory: str) -> dict:
    out = {}
    ref = _reference_accumulate(world, 2, 0.05)
    for name, config in {"one": {"stage": 2}, "many": {"stage": 2, "reduce_bucket_size": 24, "overlap_comm": True},
                         "offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}.items():
        for unsynced in (False, True):
            for mode in ("none", "load-mid", "resume"):
                sub = f"{directory}/{name}-{unsynced}-{mode}"
                got = _checkpoint_run(rank, world, sub, config, unsynced, mode)
                out[f"{name} unsynced={unsynced} {mode}"] = _diff(ref, got)
    return out


@pytest.mark.timeout(150)
def test_checkpoints_between_micro_batches_and_resumed(tmp_path):
    for result in run_distributed(_checkpoint_probes, 2, str(tmp_path), timeout=130):
        assert all(v < TOL for v in result.values()), result


def _unfrozen_before_first_step(rank: int, world: int) -> dict:
    """Minimal: the first layer frozen at setup; one backward; it is unfrozen; the step. The step builds a new
    reducer whose last bucket is the first layer's, so the bucket that was last becomes an ordinary one."""
    def run(zero: bool):
        model = _model()
        _set(model[0].parameters(), False)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)  # frozen ones in the group: accepted
        engine = zero_core.setup(model, opt, {"stage": 2}) if zero else None
        if zero:
            engine.backward(_loss(model, _batch(rank, 0, 0)))
        else:
            (sum(_loss(model, _batch(r, 0, 0)) for r in range(world)) / world).backward()
        _set(model[0].parameters(), True)  # no gradient this step: not stepped
        (engine or opt).step()
        return model

    return {"max_dw": _diff(run(True), run(False))}


@pytest.mark.timeout(60)
def test_unfrozen_before_the_first_step_keeps_the_old_last_buckets_gradient():
    for result in run_distributed(_unfrozen_before_first_step, 2, timeout=50):
        assert result["max_dw"] < TOL, result


def _new_last_bucket_run(rank, world, zero: bool, at_step: int, clip_first: bool, config):
    """Two optimizers: A (AdamW) the last layer, B (AdamW, its own settings) the middle one, which holds the last bucket at setup;
    the first layer, frozen and in no group, joins A with add_param_group (after a clip, or before the step),
    so that the new reducer's last bucket is the first layer's, and B's bucket becomes an ordinary one while
    its gradients wait."""
    model = _model()
    _set(model[0].parameters(), False)
    opts = [torch.optim.AdamW(model[4].parameters(), lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(model[2].parameters(), lr=5e-2, weight_decay=0.05)]
    engine = zero_core.setup(model, opts, config) if zero else None
    steppers = engine.optimizers if zero else opts
    for step in range(STEPS):
        if zero:
            engine.backward(_loss(model, _batch(rank, step, 0)))
        else:
            (sum(_loss(model, _batch(r, step, 0)) for r in range(world)) / world).backward()
        if clip_first:
            if zero:
                engine.clip_grad_norm_(0.05)
            else:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.05)
        if step == at_step:
            _set(model[0].parameters(), True)
            group = {"params": list(model[0].parameters()), "lr": 5e-3}
            engine.add_param_group(0, group) if zero else opts[0].add_param_group(group)
        for k in (0, 1):
            steppers[k].step()
            steppers[k].zero_grad()
    if zero:
        engine.close()
    return model


def _new_last_bucket_probes(rank: int, world: int) -> dict:
    out = {}
    for name, config in {"one": {"stage": 2}, "many": {"stage": 2, "reduce_bucket_size": 24, "overlap_comm": True}}.items():
        for at_step in (0, 1):
            for clip_first in (False, True):
                ref = _new_last_bucket_run(rank, world, False, at_step, clip_first, config)
                got = _new_last_bucket_run(rank, world, True, at_step, clip_first, config)
                out[f"{name} at_step={at_step} clip_first={clip_first}"] = _diff(ref, got)
    return out


@pytest.mark.timeout(90)
def test_a_new_last_bucket_with_two_optimizers():
    for result in run_distributed(_new_last_bucket_probes, 2, timeout=80):
        assert all(v < TOL for v in result.values()), result
