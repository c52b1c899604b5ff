"""Taking over an FSDP2 / torchtitan run from DCP, and handing ours back as DCP (zero_core/checkpoint/foreign/).

The fixtures in tests/checkpoint/fixtures/dcp/ were written by the real library (make_fixtures.py: FSDP2 on 2 CPU
ranks, 4 AdamW steps on tests/support/dcp_model.py's data). Every continued run must end where one process training
all 8 steps ends: weights, Adam's moments and step, and the hyper-parameters carried over (the engines here are built
with another learning rate, which only the loaded hyper-parameters undo).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dcp_model
from distributed import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "dcp"
LAYOUTS = ("fsdp2", "torchtitan")
TOLERANCE = 1e-5
WRONG_LR = {"lr": 0.5}  # what the engine is built with; the checkpoint's 3e-2 must replace it


def _engine(stage: int, seed: int = 7):
    import zero_core

    model = dcp_model.build(seed)
    return zero_core.setup(model, dcp_model.optimizer(model, **WRONG_LR), {"stage": stage})


def _train_engine(engine, first: int, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(first, first + steps):
        engine.backward(dcp_model.loss_of(engine.module, step, rank, world))
        engine.step()
        if not engine.step_zeroes_grads:
            engine.zero_grad()


def _engine_params(engine) -> dict[str, torch.Tensor]:
    import zero_core

    with zero_core.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _difference(params: dict, reference: dict) -> float:
    if sorted(params) != sorted(reference):
        return float("inf")
    return max((params[n] - reference[n]).abs().max().item() for n in reference)


def test_fixtures_hold_the_reference_after_four_steps():
    """The fixtures are what one plain process gets after 4 AdamW steps (the reference is right), in both
    layouts: weights, the buffer, both moments, the step, and the hyper-parameters. Within TOLERANCE, not
    exactly: FSDP2 wrote them at 2 ranks, and the reference is recomputed on the CPU running the test (its vector
    width changes the float reductions: one machine here differed by 1.01e-6)."""
    from zero_core.checkpoint.foreign import ForeignSource, detect
    from zero_core.checkpoint.foreign.dcp import DCPSource
    from zero_core.layout import Range

    weights, adamw = dcp_model.reference(4)
    model_names = list(weights)
    states = list(adamw.state.values())
    for layout in LAYOUTS:
        source = DCPSource(FIXTURES / layout)
        assert sorted(source.shapes()) == sorted(model_names + ["shift"])
        assert torch.equal(source.read_whole("shift"), dcp_model.build().shift)
        for name, state in zip(model_names, states):
            numel = weights[name].numel()
            assert (source.read_whole(name) - weights[name]).abs().max() <= TOLERANCE, (layout, name)
            for key in ("exp_avg", "exp_avg_sq"):
                stored = source.read_state(name, Range(0, numel), key).view_as(state[key])
                assert (stored - state[key]).abs().max() <= TOLERANCE, (layout, name, key)
            assert source.scalars(name, torch.device("cpu"))["step"].item() == 4.0
        assert source.hyperparameters()[0]["lr"] == dcp_model.ADAMW["lr"]
        assert source.hyperparameters()[0]["betas"] == dcp_model.ADAMW["betas"]
        # the protocol every foreign source has (zero_core.checkpoint.foreign.ForeignSource); DCP keeps no more
        assert isinstance(source, ForeignSource) and detect(FIXTURES / layout) == "dcp"
        assert (source.client_state(), source.loss_scaler(), source.skipped_steps(), source.aliases()) == (
            None, None, 0, {})


def takeover_worker(rank: int, world_size: int, stages: list, extra: dict) -> dict:
    from zero_core.checkpoint import load_checkpoint

    reference, _ = dcp_model.reference(8)
    results = {}
    for layout, path in {**{layout: FIXTURES / layout for layout in LAYOUTS}, **extra}.items():
        for stage in stages:
            engine = _engine(stage)
            load_checkpoint(engine, path)
            lrs = [group["lr"] for group in engine.optimizer.param_groups]
            _train_engine(engine, 4, 4)
            results[f"{layout} -> stage {stage}"] = (_difference(_engine_params(engine), reference), lrs)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 3])
def test_take_over_fsdp2_and_torchtitan(world_size, tmp_path):
    """At 3 ranks also the fixture converted offline to our format (``convert --to zero``)."""
    from zero_core.checkpoint.convert import convert

    extra = {}
    if world_size == 3:
        extra["fsdp2 converted to ours"] = str(convert(FIXTURES / "fsdp2", tmp_path / "ours", "zero", progress=False))
    per_rank = run_distributed(takeover_worker, world_size, [2, 3], extra, timeout=200)
    problems = [f"rank {rank}, {case}: differs from the 8-step reference by {d:.3g}; lrs {lrs}"
                for rank, results in enumerate(per_rank) for case, (d, lrs) in results.items()
                if not d <= TOLERANCE or lrs != [dcp_model.ADAMW["lr"]]]
    assert len(per_rank[0]) == 2 * (len(LAYOUTS) + len(extra))
    assert not problems, "\n".join(problems)


def handback_worker(rank: int, world_size: int, directory: str) -> dict:
    """Our engine trains 4 steps from the reference's start and saves; the checkpoint is converted to DCP; real
    FSDP2 (built with another init and learning rate) dcp.loads it, set_state_dicts it and trains 4 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    import zero_core
    from zero_core.checkpoint import save_checkpoint
    from zero_core.checkpoint.convert import convert

    reference, _ = dcp_model.reference(8)
    results = {}
    for stage, layout in ((2, "fsdp2"), (3, "torchtitan")):
        model = dcp_model.build()
        engine = zero_core.setup(model, dcp_model.optimizer(model), {"stage": stage})
        _train_engine(engine, 0, 4)
        ours, theirs = f"{directory}/stage{stage}", f"{directory}/stage{stage}-{layout}"
        save_checkpoint(engine, ours)
        if rank == 0:
            convert(ours, theirs, "dcp", layout=layout, progress=False)
        dist.barrier()
        fsdp, adamw = dcp_model.build_fsdp2(seed=9, **WRONG_LR)
        options = StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan")
        msd, osd = get_state_dict(fsdp, adamw, options=options)
        state = {"model": msd, "optim": osd} if layout == "fsdp2" else {**msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=theirs)
        loaded_osd = state["optim"] if layout == "fsdp2" else state["optimizer"]
        set_state_dict(fsdp, adamw, model_state_dict=msd, optim_state_dict=loaded_osd, options=options)
        for step in range(4, 8):
            dcp_model.loss_of(fsdp, step, rank, world_size).backward()
            adamw.step()
            adamw.zero_grad()
        params = {n: p.full_tensor().detach() for n, p in fsdp.named_parameters()}
        results[f"stage {stage} -> DCP ({layout}) -> FSDP2"] = (_difference(params, reference),
                                                              [g["lr"] for g in adamw.param_groups])
    return results


@pytest.mark.timeout(240)
def test_hand_back_to_fsdp2(tmp_path):
    per_rank = run_distributed(handback_worker, 2, str(tmp_path), timeout=200)
    problems = [f"rank {rank}, {case}: differs from the 8-step reference by {d:.3g}; lrs {lrs}"
                for rank, results in enumerate(per_rank) for case, (d, lrs) in results.items()
                if not d <= TOLERANCE or lrs != [dcp_model.ADAMW["lr"]]]
    assert len(per_rank[0]) == 2
    assert not problems, "\n".join(problems)


def _fixture_state(path: Path) -> tuple[dict, dict]:
    """Weights and per-parameter optimizer state (moments and step) of a DCP directory, whole."""
    from zero_core.checkpoint.foreign.dcp import DCPSource
    from zero_core.layout import Range

    source = DCPSource(path)
    weights = {n: source.read_whole(n) for n in source.shapes()}
    state = {n: {k: source.read_state(n, Range(0, w.numel()), k) for k in source.state_keys()}
             | source.scalars(n, torch.device("cpu")) for n, w in weights.items() if source.has_state(n)}
    return weights, state, source.stored_groups()


def test_convert_round_trip_through_the_command(tmp_path, capsys):
    """DCP -> ours -> DCP (torchtitan keys) -> ours, through ``zero-checkpoint convert``: every weight, moment,
    step and hyper-parameter comes through exactly."""
    from zero_core.checkpoint import consolidated_state_dict, read_optimizer_states
    from zero_core.checkpoint.cli import main

    quiet = ["--progress", "false"]
    main(["convert", str(FIXTURES / "fsdp2"), str(tmp_path / "ours"), "--to", "zero", *quiet])
    main(["convert", str(tmp_path / "ours"), str(tmp_path / "theirs"), "--to", "dcp", "--layout", "torchtitan", *quiet])
    main(["convert", str(tmp_path / "theirs"), str(tmp_path / "ours-again"), "--to", "zero", *quiet])
    assert f"wrote {tmp_path / 'ours-again'}" in capsys.readouterr().out
    weights, state, groups = _fixture_state(FIXTURES / "fsdp2")
    round_tripped = _fixture_state(tmp_path / "theirs")
    assert sorted(weights) == sorted(round_tripped[0])
    assert all(torch.equal(weights[n], round_tripped[0][n]) for n in weights)
    assert all(torch.equal(state[n][k], round_tripped[1][n][k]) for n in state for k in state[n])
    assert round_tripped[2] == groups
    for ours in (tmp_path / "ours", tmp_path / "ours-again"):
        model = consolidated_state_dict(ours)
        assert sorted(model) == sorted(weights) and all(torch.equal(model[n], weights[n]) for n in weights)
        (optimizer,) = read_optimizer_states(ours)
        names = groups[0][0]
        assert [g["params"] for g in optimizer["param_groups"]] == [list(range(len(names)))]
        assert {k: v for k, v in optimizer["param_groups"][0].items() if k != "params"} == groups[1][0]
        for index, name in enumerate(names):
            saved = optimizer["state"][index]
            assert torch.equal(saved["step"], state[name]["step"])
            assert all(torch.equal(saved[k].reshape(-1), state[name][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_convert_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    from zero_core.checkpoint import convert as convert_module
    from zero_core.checkpoint.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(FIXTURES / "fsdp2"), str(tmp_path / "out"), "--to", "dcp"])
    assert "is a dcp checkpoint: --to dcp converts our checkpoints" in str(exit_info.value)
    assert "convert it with --to zero first" in str(exit_info.value)
    # a writer whose module is not in this build (as --to deepspeed before its reader lands)
    monkeypatch.setitem(convert_module.WRITERS, "deepspeed", ("zero_core.checkpoint.foreign.not_here", "write"))
    main(["convert", str(FIXTURES / "fsdp2"), str(tmp_path / "ours"), "--to", "zero", "--progress", "false"])
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "ours"), str(tmp_path / "ds"), "--to", "deepspeed"])
    assert "--to deepspeed is not available in this version of lightning-zero" in str(exit_info.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "ds").exists()


def test_hand_back_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """When torch's writer asks for a tensor, at most the one before is still alive (torch's loop variable holds
    it until the next read returns). torch keeps every tensor of a data file until the file is closed: with
    one file for all, all 24 before would be alive at the last read."""
    import weakref

    from zero_core.checkpoint.convert import convert
    from zero_core.checkpoint.foreign import dcp_writer

    convert(FIXTURES / "fsdp2", tmp_path / "ours", "zero", progress=False)
    alive_at_each_read, given = [], []
    original = dcp_writer._ReadingPlanner.resolve_data

    def watched(self, write_item):
        tensor = original(self, write_item)
        if write_item.index.fqn in self.lazy:
            alive_at_each_read.append(sum(ref() is not None for ref in given))
            # the storage of a tensor made from a numpy array keeps the array alive: a weak reference to the
            # array sees the storage, through every view and detach() torch makes of the tensor
            array = tensor.numpy().copy()
            given.append(weakref.ref(array))
            tensor = torch.from_numpy(array)
        return tensor

    monkeypatch.setattr(dcp_writer._ReadingPlanner, "resolve_data", watched)
    convert(tmp_path / "ours", tmp_path / "theirs", "dcp", progress=False)
    assert len(alive_at_each_read) == 8 * 3 + 1  # weights and both moments of 8 parameters, and the buffer
    assert max(alive_at_each_read) <= 1, alive_at_each_read


class Odd:
    """Pickled into a DCP entry by a user's state: loading it would run this module's code."""


def _save_dcp(state: dict, path: Path) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


def _bad_directories(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    """case -> (DCP directory, what its error must say; None: it loads, the weights of ``build(0)``)."""
    from torch.distributed.checkpoint import FileSystemReader

    from zero_core.checkpoint.convert import convert

    weights = dict(dcp_model.build().state_dict())
    names = [n for n, _ in dcp_model.build().named_parameters()]
    groups = [{"lr": 0.1, "params": names}]
    gap = tmp_path / "lost-chunk"
    shutil.copytree(FIXTURES / "fsdp2", gap)
    metadata = FileSystemReader(str(gap)).read_metadata()
    del metadata.state_dict_metadata["model.mid.weight"].chunks[1]  # rank 1's rows, as if never saved
    with open(gap / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(FIXTURES / "fsdp2", unfinished)
    (unfinished / ".metadata").unlink()
    missing = tmp_path / "missing-file"
    shutil.copytree(FIXTURES / "fsdp2", missing)
    (missing / "__1_0.distcp").unlink()
    model_only = _save_dcp({"model": weights}, tmp_path / "model-only")
    return {
        "model only": (model_only, None),  # the positive controls: a good directory loads, its weights arrive
        "model only, converted to ours": (str(convert(model_only, tmp_path / "model-only-ours", "zero",
                                                      progress=False)), None),
        "bytes entry in the model": (_save_dcp({"model": {**weights, "inp.extra": "hello"}}, tmp_path / "bytes"),
                                     ["'model.inp.extra' is not a tensor", "bytes entry"]),
        "shapes": (_save_dcp({"model": {**weights, "inp.weight": torch.zeros(45, 12), "out.bias": torch.zeros(8)}},
                             tmp_path / "shapes"),
                   ["shape mismatch", "'inp.weight': checkpoint (45, 12), model (45, 11)",
                    "'out.bias': checkpoint (8,), model (7,)"]),
        "missing data file": (str(missing), ["missing its data file '__1_0.distcp'"]),
        "unfinished save": (str(unfinished), ["holds DCP data files (.distcp) but no .metadata", "did not finish"]),
        "lost chunk": (str(gap), ["'model.mid.weight' of shape (31, 45) is stored in 1 chunks of 720 elements in "
                                  "all, not 1395"]),
        "state of another shape": (_save_dcp({"model": weights, "optim": {
            "state": {"inp.weight": {"exp_avg_row": torch.zeros(45), "step": torch.tensor(1.0)}},
            "param_groups": groups}}, tmp_path / "factored"),
            ["'optim.state.inp.weight.exp_avg_row' has shape (45,)", "cannot be sharded"]),
        "groups of other parameters": (_save_dcp({"model": weights, "optim": {"state": {}, "param_groups": [
            {**groups[0], "params": ["elsewhere.weight"]}]}}, tmp_path / "other-groups"),
            ["no optimizer hyper-parameters for the engine's group of ['inp.weight', 'inp.bias', 'mid.weight']"]),
        "pickled object": (_save_dcp({"model": weights, "optim": {"state": {}, "param_groups": [{**groups[0],
                                                                                                   "lr": Odd()}]}},
                                     tmp_path / "pickled"),
                           ["'optim.param_groups.0.lr'", "not a plain value", "test_takeover_dcp.Odd"]),
    }


def _masters(engine) -> torch.Tensor:
    """This rank's fp32 masters, which a load fills before it rebuilds the model's weights from them."""
    return torch.cat([fragment.master_values().clone().reshape(-1) for fragment in engine.fragments()])


def bad_input_worker(rank: int, world_size: int, cases: dict) -> dict:
    """Each bad directory fails to load with its message, on every rank, and leaves the engine as it was (its
    weights and its fp32 masters)."""
    from zero_core.checkpoint import load_checkpoint

    results = {}
    saved = {n: p.detach() for n, p in dcp_model.build().named_parameters()}
    for case, (path, expected) in cases.items():
        engine = _engine(3)
        before, masters = _engine_params(engine), _masters(engine)
        try:
            load_checkpoint(engine, path)
            message = None
        except Exception as error:  # the message is what the test checks
            message = f"{type(error).__name__}: {error}"
        changed = _difference(_engine_params(engine), before if expected else saved)
        if expected:
            changed = max(changed, (_masters(engine) - masters).abs().max().item())
        results[case] = (message, changed)
    return results


@pytest.mark.timeout(240)
def test_bad_input_is_refused_before_anything_loads(tmp_path):
    """Beside the bad directories, a model-only one (torchtitan's model_weights_only export) and its conversion
    to ours load, so the worker's "unchanged" check is not vacuous."""
    cases = _bad_directories(tmp_path)
    per_rank = run_distributed(bad_input_worker, 2, cases, timeout=200)
    problems = []
    for rank, results in enumerate(per_rank):
        for case, (message, changed) in results.items():
            expected = cases[case][1]
            if expected is None and message is not None:
                problems.append(f"rank {rank}, {case}: expected to load, got {message!r}")
            if expected is not None and (message is None or not all(part in message for part in expected)):
                problems.append(f"rank {rank}, {case}: expected {expected} in the error, got {message!r}")
            if changed != 0.0:
                what = "the failed load changed the weights" if expected else "the loaded weights differ"
                problems.append(f"rank {rank}, {case}: {what} by {changed:.3g}")
    assert len(per_rank[0]) == len(cases)
    assert not problems, "\n".join(problems)


def test_a_read_touches_only_the_chunks_it_overlaps(monkeypatch):
    """Rows held by the saving rank 0 are read from its chunk alone; rows across the cut from both."""
    from torch.distributed.checkpoint import FileSystemReader

    from zero_core.checkpoint.foreign.dcp import DCPSource
    from zero_core.layout import Range

    read = []
    original = FileSystemReader.read_data

    def recording(self, plan, planner):
        read.extend((item.storage_index.fqn, tuple(item.storage_index.offset or ())) for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    source = DCPSource(FIXTURES / "fsdp2")  # model.mid.weight (31, 45): rows 0-15 on rank 0, 16-30 on rank 1
    read.clear()
    first_rows = source.read("mid.weight", Range(45, 45 * 3))
    assert read == [("model.mid.weight", (0, 0))]
    read.clear()
    across = source.read("mid.weight", Range(45 * 15 + 7, 45 * 17))
    assert sorted(read) == [("model.mid.weight", (0, 0)), ("model.mid.weight", (16, 0))]
    whole = source.read_whole("mid.weight").reshape(-1)
    assert torch.equal(first_rows, whole[45:45 * 3]) and torch.equal(across, whole[45 * 15 + 7:45 * 17])


def test_hyper_parameters_follow_the_parameters_not_the_group_order(tmp_path):
    """Two groups (weight decay on matrices only), stored nested and flattened: each of the engine's groups gets
    the values stored for its parameters, whatever order the groups were stored in."""
    from zero_core.checkpoint.foreign.dcp import DCPSource

    model = dcp_model.build()
    weights = dict(model.state_dict())
    matrices = [n for n, p in model.named_parameters() if p.ndim >= 2]
    vectors = [n for n, p in model.named_parameters() if p.ndim < 2]
    decay = {n: 0.1 if n in matrices else 0.0 for n in matrices + vectors}
    state = {n: {"exp_avg": torch.zeros_like(weights[n]), "step": torch.tensor(1.0)} for n in decay}
    nested = _save_dcp({"model": weights, "optim": {"state": state, "param_groups": [
        {"lr": 0.1, "weight_decay": 0.1, "params": matrices}, {"lr": 0.1, "weight_decay": 0.0, "params": vectors}]}},
        tmp_path / "nested")
    flat = {f"state.{n}.{k}": v for n, values in state.items() for k, v in values.items()}
    flat.update({f"param_groups.{n}.{hp}": v for n in decay for hp, v in (("lr", 0.1), ("weight_decay", decay[n]))})
    flattened = _save_dcp({**weights, "optimizer": flat}, tmp_path / "flattened")
    for path in (nested, flattened):
        source = DCPSource(Path(path), group_param_names=[vectors, matrices])
        assert [g["weight_decay"] for g in source.hyperparameters()] == [0.0, 0.1], path
        names, values = source.stored_groups()
        assert [sorted(n) for n in names] == [sorted(matrices), sorted(vectors)], path
        assert [v["weight_decay"] for v in values] == [0.1, 0.0], path
