"""Taking over a DeepSpeed run: checkpoints the real DeepSpeed 0.19.8 wrote (tests/checkpoint/fixtures/deepspeed,
made by make_fixtures.py there: 4 AdamW steps at 2 ranks) loaded by our engine at other world sizes and stages.

The reference is one plain process training tests/support/takeover_model.py for all 8 steps; DeepSpeed's own view of its
masters and moments (`<fixture>-expected.pt`, from safe_get_full_fp32_param) checks the reader exactly.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

import takeover_model as tm
from distributed import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
ALL = ("stage1-fp32", "stage2-fp32", "stage3-fp32", "stage2-bf16", "stage3-bf16", "stage2-frozen", "stage3-frozen")
TOLERANCE = 1e-5
# Our stage 3 with the optimizer on NVMe and tiles of 100 elements: the Linear weights' pieces are bigger than a
# tile, so the load fills them in the swap file a slice at a time (offload/piece_in_file.py)
NVME = "3, optimizer on nvme"
# (fixture, our stage): DeepSpeed's stage 2 and 3 runs, each continued under our stage 2 and 3.
CONTINUE = [(f"stage{ds}-fp32", ours) for ds in (2, 3) for ours in (2, 3)] + [("stage1-fp32", 1)] + [
    ("stage2-frozen", 3), ("stage3-frozen", 2),  # with a frozen middle layer (DeepSpeed's frozen_param_fragments)
    ("stage2-fp32", NVME)]
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def expected(fixture: str) -> dict:
    return torch.load(FIXTURES / f"{fixture}-expected.pt", weights_only=True)


def test_reference_matches_deepspeed_after_four_steps():
    reference = tm.reference_params(tm.STEPS_BEFORE)
    for fixture in ("stage1-fp32", "stage2-fp32", "stage3-fp32"):
        saved = expected(fixture)
        worst = max((saved[f"{n}/fp32"] - p).abs().max().item() for n, p in reference.items())
        assert worst <= TOLERANCE, f"{fixture}: DeepSpeed's weights differ from the plain reference by {worst:.3g}"


@pytest.mark.parametrize("fixture", ALL)
def test_reader_gives_what_deepspeed_holds(fixture):
    from zero_core.checkpoint.foreign import ForeignSource, detect, open_source
    from zero_core.layout import Range

    saved = expected(fixture)
    assert detect(FIXTURES / fixture) == detect(FIXTURES / fixture / "global_step4") == "deepspeed"
    with open_source(FIXTURES / fixture / "global_step4") as tag_folder:  # the tag folder alone reads the same
        assert torch.equal(tag_folder.read_whole("out.weight"), saved["out.weight/fp32"])
    with open_source(FIXTURES / fixture) as source:
        assert isinstance(source, ForeignSource)
        names, values = source.stored_groups()
        assert source.has_optimizer() and sum(map(len, names)) == len(source.param_shapes)
        assert values == source.hyperparameters()
        assert source.world == 2 and source.stage == int(fixture[5])
        for name, shape in source.param_shapes.items():
            numel = math.prod(shape)
            for kind in KINDS:  # exactly, the bf16 runs' fp32 masters and moments too
                assert torch.equal(source.read(name, Range(0, numel), kind).view(shape), saved[f"{name}/{kind}"])
            assert torch.equal(source.read(name, Range(2, numel - 3)), saved[f"{name}/fp32"].reshape(-1)[2:-3])
            assert source.scalars(name, torch.device("cpu"))["step"].item() == tm.STEPS_BEFORE
        assert source.state_keys() == ["exp_avg", "exp_avg_sq"]
        assert [g["lr"] for g in source.hyperparameters()] == saved["lr"].tolist()
        assert [g["weight_decay"] for g in source.hyperparameters()] == [tm.WEIGHT_DECAY, 0.0]
        assert torch.equal(source.read_whole("input_scale"), tm.TakeoverMLP().input_scale)
        if "frozen" in fixture:  # never trained: DeepSpeed's values are the initial ones
            assert sorted(source.shapes()) == sorted(tm.TakeoverMLP().state_dict())
            for name in ("mid.weight", "mid.bias"):
                assert name not in source.param_shapes
                assert torch.equal(source.read_whole(name), saved[f"{name}/frozen"])
                assert torch.equal(saved[f"{name}/frozen"], tm.TakeoverMLP().state_dict()[name])
        client = source.client_state()
        assert client["epoch"] == 1 and client["note"] == "taken over" and client["global_steps"] == 4
        assert torch.equal(client["samples_seen"], torch.tensor([24]))
        assert client["lr_scheduler"]["last_epoch"] == tm.STEPS_BEFORE
        assert source.loss_scaler() is None and source.skipped_steps() == 0


def _config(stage) -> dict:
    if stage != NVME:
        return {"stage": stage}
    import tempfile

    return {"stage": 3, "sub_group_size": 100,
            "offload_optimizer": {"device": "nvme", "nvme_path": tempfile.mkdtemp(prefix="takeover-nvme-")}}


def continue_worker(rank: int, world: int, cases: list, exact: list) -> dict:
    """``cases``: (checkpoint directory, our stage), continued 4 steps; ``exact``: (fixture, our stage), compared
    with DeepSpeed's own values right after loading."""
    import zero_core

    results = {}
    references = {frozen: tm.reference_params(tm.STEPS_BEFORE + tm.STEPS_AFTER, frozen=frozen)
                  for frozen in (False, True)}
    for fixture, stage in cases:
        frozen = "frozen" in fixture
        reference = references[frozen]
        model = tm.TakeoverMLP(seed=7, frozen=frozen)  # other weights: only the load can make them right
        optimizer = tm.make_optimizer(model)
        scheduler = tm.make_scheduler(optimizer)
        engine = zero_core.setup(model, optimizer, _config(stage))
        client = engine.load_checkpoint(str(FIXTURES / fixture))  # an absolute path stays as it is
        scheduler.load_state_dict(client["lr_scheduler"])
        for step in range(client["global_steps"], client["global_steps"] + tm.STEPS_AFTER):
            loss = tm.loss_fn(engine.module, tm.rank_batch(step, rank, world))
            engine.backward(loss)
            engine.step()
            if not engine.step_zeroes_grads:
                engine.zero_grad()
            scheduler.step()
        params = {n: p.detach().float() for n, p in engine.module.named_parameters()}
        results[f"{fixture} -> stage {stage}"] = max((params[n] - p).abs().max().item() for n, p in reference.items())
        engine.close()
    for fixture, stage in exact:
        model = tm.TakeoverMLP(seed=7)
        engine = zero_core.setup(model, tm.make_optimizer(model), _config(stage))
        engine.load_checkpoint(str(FIXTURES / fixture))
        with engine.offload_resident():  # NVMe: everything read in, to compare
            results[f"{fixture} loaded exactly at stage {stage}"] = _exact_difference(engine, expected(fixture))
        engine.close()
    return results


def _exact_difference(engine, saved: dict) -> float:
    """The largest difference between this rank's masters and Adam state and DeepSpeed's own values."""
    state = {m: s for inner in engine.inner_optimizers for m, s in inner.state.items()}
    worst = 0.0
    for fragment in engine.fragments():
        values = {"fp32": fragment.master_values()}
        values.update({k: state[fragment.master][k][fragment.local.as_slice()] for k in KINDS[1:]})
        for kind, value in values.items():
            full = saved[f"{fragment.name}/{kind}"].reshape(-1)[fragment.param_range.as_slice()]
            worst = max(worst, (value - full).abs().max().item())
        if state[fragment.master]["step"].item() != tm.STEPS_BEFORE:
            return float("inf")
    return worst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 3])
def test_take_over_and_continue(world, tmp_path):
    from zero_core.checkpoint.foreign.to_zero import write_zero_checkpoint

    # Also DeepSpeed's stage 3 run converted offline to our format (zero-checkpoint convert --to zero).
    converted = write_zero_checkpoint(FIXTURES / "stage3-fp32", tmp_path / "converted", progress=False)
    cases = CONTINUE + [(str(converted), 2 if world == 3 else 3)]
    exact = [("stage2-bf16", 3), ("stage3-bf16", 2)] if world == 3 else [("stage3-bf16", 3)]
    exact.append(("stage3-fp32", NVME))
    per_rank = run_distributed(continue_worker, world, cases, exact, timeout=200)
    problems = [f"world {world}, rank {rank}: {case} differs by {d:.3g}"
                for rank, results in enumerate(per_rank) for case, d in results.items()
                if not d <= (0.0 if "exactly" in case else TOLERANCE)]
    assert not problems, "\n".join(problems)


# -- bad input ---------------------------------------------------------------------------------------------


def _copy(tmp_path: Path, fixture: str = "stage2-fp32") -> Path:
    target = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, target)
    return target


def _refusal(path: Path) -> str:
    from zero_core.checkpoint import CheckpointError
    from zero_core.checkpoint.foreign import open_source

    with pytest.raises(CheckpointError) as caught:
        open_source(path)
    return str(caught.value)


def test_model_parallel_layout_is_refused(tmp_path):
    folder = _copy(tmp_path) / "global_step4"
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    message = _refusal(folder.parent)
    assert "mp_rank_01_model_states.pt" in message and "tensor- or pipeline-parallel" in message


def test_moe_expert_file_is_refused(tmp_path):
    folder = _copy(tmp_path) / "global_step4"
    shutil.copy(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                folder / "expp_rank_0_mp_rank_00_optim_states.pt")
    message = _refusal(folder.parent)
    assert "expp_rank_0_mp_rank_00_optim_states.pt" in message and "Mixture-of-Experts" in message


@pytest.mark.parametrize("fixture", ["stage2-fp32", "stage3-bf16"])
def test_missing_rank_file_is_named(tmp_path, fixture):
    folder = _copy(tmp_path, fixture) / "global_step4"
    prefix = "bf16_" if "bf16" in fixture else ""
    (folder / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    message = _refusal(folder.parent)
    assert f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt" in message and "2 ranks" in message
    shutil.move(folder / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt",
                folder / f"{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert f"lacks '{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt'" in _refusal(folder.parent)


def test_class_outside_the_allow_list_is_refused_and_never_run(tmp_path):
    folder = _copy(tmp_path) / "global_step4"
    marker = tmp_path / "ran"
    state = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    state["payload"] = _RunsCode(str(marker))
    torch.save(state, folder / "mp_rank_00_model_states.pt")
    message = _refusal(folder.parent)
    assert "mp_rank_00_model_states.pt" in message and "posix.mkdir" in message
    assert not marker.exists()


class _RunsCode:
    """Unpickling this would create a directory: a stand-in for any code a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_fp16_dynamic_loss_scaler_is_read(tmp_path):
    """No fp16 fixture (DeepSpeed has no fp16 on this CPU): the rank files get the scaler an fp16 run pickles,
    a DynamicLossScaler object under DeepSpeed's class name, with the attributes DeepSpeed 0.19.8 gives it."""
    import sys
    import types

    from zero_core.checkpoint.foreign import open_source
    from zero_core.checkpoint.foreign.deepspeed import STAND_INS
    from zero_core.checkpoint.foreign.unpickle import load_restricted

    name = "deepspeed.runtime.fp16.loss_scaler"
    modules = {".".join(name.split(".")[:i]): types.ModuleType(".".join(name.split(".")[:i])) for i in range(1, 5)}
    scaler_class = type("DynamicLossScaler", (), {"__module__": name})
    modules[name].DynamicLossScaler = scaler_class
    scaler = scaler_class()
    scaler.__dict__.update(cur_scale=1024.0, cur_iter=37, last_overflow_iter=30, scale_factor=2.0, scale_window=1000,
                           min_scale=1.0, delayed_shift=2, cur_hysteresis=1, consecutive_hysteresis=False,
                           raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)
    folder = _copy(tmp_path) / "global_step4"
    saved_modules = {n: sys.modules.get(n) for n in modules}
    sys.modules.update(modules)  # only so that pickle can name the class while saving
    try:
        for rank in (0, 1):
            file = folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            state = load_restricted(file, STAND_INS)
            optimizer = state["optimizer_state_dict"]
            del optimizer["param_slice_mappings"]  # stand-ins of ours: not what a DeepSpeed file holds
            optimizer.update(loss_scaler=scaler, dynamic_loss_scale=True)
            torch.save(state, file.with_suffix(".new"))  # a new file: the old one is memory-mapped by state
            os.replace(file.with_suffix(".new"), file)
    finally:
        for n, module in saved_modules.items():
            if module is None:
                del sys.modules[n]
            else:
                sys.modules[n] = module
    with open_source(folder.parent) as source:
        assert source.loss_scaler() == {"scale": 1024.0, "hysteresis_left": 1, "iteration": 37, "last_overflow": 30}


def test_a_directory_of_neither_kind_says_what_it_would_read(tmp_path):
    from zero_core.checkpoint import CheckpointError, read_manifest
    from zero_core.checkpoint.foreign import detect

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert detect(tmp_path) is None
    with pytest.raises(CheckpointError, match="no manifest.json .* not a foreign checkpoint .*DeepSpeed"):
        read_manifest(tmp_path)


def mismatch_worker(rank: int, world: int, bad: str) -> list:
    import zero_core
    from zero_core.checkpoint import CheckpointError, CheckpointMismatchError

    messages = []
    model = tm.TakeoverMLP(seed=7)
    model.mid, model.out = torch.nn.Linear(47, 30), torch.nn.Linear(30, 7)
    engine = zero_core.setup(model, tm.make_optimizer(model), {"stage": 3})
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(str(FIXTURES / "stage3-fp32"))
    except CheckpointMismatchError as error:
        messages.append(str(error))
    after = {n: p.detach() for n, p in engine.module.named_parameters()}
    messages.append(all(torch.equal(before[n], after[n]) for n in before))
    try:
        engine.load_checkpoint(bad)
    except CheckpointError as error:
        messages.append(str(error))
    return messages


@pytest.mark.timeout(120)
def test_shape_mismatch_names_every_shape_and_loads_nothing(tmp_path):
    folder = _copy(tmp_path, "stage3-fp32") / "global_step4"
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    for rank, messages in enumerate(run_distributed(mismatch_worker, 2, str(folder.parent), timeout=100)):
        mismatch, unchanged, missing = messages
        for name, saved, model in (("mid.weight", (31, 47), (30, 47)), ("mid.bias", (31,), (30,)),
                                   ("out.weight", (7, 31), (7, 30))):
            assert f"'{name}': checkpoint {saved}, model {model}" in mismatch, (rank, mismatch)
        assert unchanged, f"rank {rank}: a refused load changed the model"
        assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in missing, (rank, missing)


# -- hand back ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["stage2-fp32", "stage3-bf16"])
def test_hand_back_as_a_deepspeed_universal_checkpoint(tmp_path, fixture):
    """DeepSpeed's run -> ours (convert --to zero) -> DeepSpeed universal (convert --to deepspeed): every file
    where DeepSpeed's load_universal_checkpoint looks, holding DeepSpeed's own values and no pickled class."""
    from zero_core.checkpoint.cli import main
    from zero_core.checkpoint.foreign.unpickle import pickle_globals

    main(["convert", str(FIXTURES / fixture), str(tmp_path / "ours"), "--to", "zero", "--progress", "false"])
    main(["convert", str(tmp_path / "ours"), str(tmp_path / "uc"), "--to", "deepspeed", "--progress", "false"])
    saved, uc = expected(fixture), tmp_path / "uc"
    assert (uc / "latest_universal").read_text() == "global_step4"
    folder = uc / "global_step4"
    params = [n for n in tm.TakeoverMLP().state_dict() if n != "input_scale"]
    assert sorted(p.name for p in (folder / "zero").iterdir()) == sorted(params + ["input_scale", "optimizer_state.pt"])
    for name in params:
        assert sorted(p.name for p in (folder / "zero" / name).iterdir()) == [
            "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        for kind in KINDS:
            stored = torch.load(folder / "zero" / name / f"{kind}.pt", weights_only=True)
            assert list(stored) == ["param"] and torch.equal(stored["param"], saved[f"{name}/{kind}"]), (name, kind)
        assert torch.load(folder / "zero" / name / "step.pt", weights_only=True).item() == tm.STEPS_BEFORE
    optimizer = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=True)
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [tm.WEIGHT_DECAY, 0.0]
    assert all("params" not in g for g in optimizer["param_groups"]) and optimizer["ds_version"]
    assert optimizer["optimizer_state_dict"]["state"][0]["step"].item() == tm.STEPS_BEFORE
    for states_file in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        states = torch.load(folder / states_file, weights_only=True)
        assert states["global_steps"] == 4 and states["skipped_steps"] == 0 and states["epoch"] == 1
        assert states["lr_scheduler"]["last_epoch"] == tm.STEPS_BEFORE and states["buffer_names"] == ["input_scale"]
        assert [list(g) for g in states["param_shapes"]] == [["inp.weight", "mid.weight", "out.weight"],
                                                             ["inp.bias", "norm.weight", "norm.bias", "mid.bias",
                                                              "out.bias"]]
    for file in folder.rglob("*.pt"):  # plain containers and tensors: DeepSpeed needs nothing of ours to read them
        assert {g for g in pickle_globals(file) if not g.startswith(("torch.", "collections."))} == set(), file
    assert "a DeepSpeed universal checkpoint" in _refusal(folder)  # not read back: a clear error, not a wrong load


def test_hand_back_refuses_what_deepspeed_cannot_take(tmp_path):
    import json

    from zero_core.checkpoint import CheckpointError
    from zero_core.checkpoint.foreign.deepspeed_universal import write_deepspeed_universal
    from zero_core.checkpoint.foreign.to_zero import write_zero_checkpoint

    ours = write_zero_checkpoint(FIXTURES / "stage2-fp32", tmp_path / "ours", progress=False)
    manifest = json.loads((ours / "manifest.json").read_text())
    manifest["optimizer"]["per_element_keys"] = ["momentum_buffer"]
    (ours / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="momentum_buffer.*Adam's"):
        write_deepspeed_universal(ours, tmp_path / "uc", progress=False)
    assert not (tmp_path / "uc").exists()
