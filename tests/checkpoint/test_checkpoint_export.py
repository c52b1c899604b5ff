"""Consolidation and 16-bit export: the files load into a fresh model with plain torch and safetensors, and
give the same outputs as the in-memory model; tied weights stay tied; the CLI consolidates, inspects and
exports optimizer state.

One spawn (world size 2, bf16, stage 3 when it exists) trains, saves a checkpoint, calls save_16bit_model and
records the in-memory model's outputs and fp32 masters; everything else runs offline in the test process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from distributed import run_distributed
from models import build_model, make_batch
from checkpoint_runs import ZeroRun, stages


def _config(stage: int) -> dict:
    config = {"stage": stage, "bf16": {"enabled": True}, "reduce_bucket_size": 300, "allgather_bucket_size": 300}
    if stage == 3:
        config["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def logits(module, batches) -> list[torch.Tensor]:
    """The LM head's outputs (not just the loss) on each batch."""
    captured = []
    hook = module.head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        for batch in batches:
            module(*batch)
    hook.remove()
    return captured


def fixed_batches() -> list:
    return [make_batch("transformer", 7, step, 0) for step in range(2)]


def export_worker(rank: int, world_size: int, directory: str, stage: int) -> bool:
    from zero_core import safe_get_full_fp32_param
    from zero_core.checkpoint import save_16bit_model, save_checkpoint

    directory = Path(directory)
    run = ZeroRun("transformer", _config(stage))
    run.train(3)
    save_checkpoint(run.engine, directory / "ckpt", run.client_state())
    saved = save_16bit_model(run.engine, directory / "live16", max_shard_size="6KB")
    masters = {n: safe_get_full_fp32_param(p) for n, p in run.engine.module.named_parameters()}
    outputs = logits(run.engine.module, fixed_batches())  # every rank runs it: stage 3 gathers in forward
    if rank == 0:
        torch.save({"masters": masters, "outputs": outputs}, directory / "expected.pt")
    dist.barrier()
    return saved and _refuses_without_gather_flag(stage, directory)


def _refuses_without_gather_flag(stage: int, directory: Path) -> bool:
    """Stage 3 without stage3_gather_16bit_weights_on_model_save: nothing is written, as in DeepSpeed."""
    from zero_core.checkpoint import save_16bit_model

    if stage != 3:
        return True
    run = ZeroRun("mlp", {"stage": 3})
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        saved = save_16bit_model(run.engine, directory / "not-written")
    return saved is False and not (directory / "not-written").exists()


def load_sharded(directory: Path) -> tuple[dict, dict]:
    """A model state dict the way any user would read it: the index, then load_file on each shard."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(directory / file))
    return state, index


def fresh_outputs(directory: Path) -> tuple[list, list, dict, torch.nn.Module]:
    state, index = load_sharded(directory)
    model = build_model("transformer", seed=5).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["head.weight"] and not unexpected, (missing, unexpected)
    assert model.head.weight is model.tok.weight
    return logits(model, fixed_batches()), sorted(set(index["weight_map"].values())), index, model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("export")
    stage = max(stages())
    saved = run_distributed(export_worker, 2, str(directory), stage, timeout=150)
    assert saved == [True, True], "save_16bit_model did not save, or saved in stage 3 without the gather flag"
    torch.set_num_threads(1)  # the ranks computed their outputs on one thread
    return directory, stage, torch.load(directory / "expected.pt", weights_only=True)


@pytest.mark.timeout(240)
def test_bf16_consolidation_and_16bit_export_load_into_a_fresh_model(exported, capsys):
    from zero_core.checkpoint.cli import main

    directory, _, expected = exported
    main(["consolidate", str(directory / "ckpt"), str(directory / "bf16"), "--dtype", "bf16",
          "--max-shard-size", "6KB", "--progress", "false"])
    for out in ("bf16", "live16"):
        outputs, files, index, model = fresh_outputs(directory / out)
        assert len(files) > 1, f"{out}: expected several shards of at most 6KB, got {files}"
        assert index["metadata"]["tied_weights"] == {"head.weight": "tok.weight"}
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(outputs, expected["outputs"], strict=True)), out


def test_fp32_consolidation_equals_the_masters(exported):
    from zero_core.checkpoint import consolidate

    directory, _, expected = exported
    consolidate(directory / "ckpt", directory / "fp32", max_shard_size="1GB", progress=False)
    state, index = load_sharded(directory / "fp32")
    masters = {n: t for n, t in expected["masters"].items() if n != "head.weight"}
    assert sorted(state) == sorted(masters) and len(set(index["weight_map"].values())) == 1
    assert all(torch.equal(state[n], masters[n]) for n in masters)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in masters.values())
    # Consolidating again replaces the earlier output; an unrelated directory is never replaced.
    consolidate(directory / "ckpt", directory / "fp32", progress=False)
    (directory / "mine").mkdir()
    (directory / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="refusing to replace"):
        consolidate(directory / "ckpt", directory / "mine", progress=False)


def test_cli_inspect_and_optimizer_export(exported, capsys):
    from zero_core.checkpoint.cli import main

    directory, stage, expected = exported
    main(["inspect", str(directory / "ckpt"), "--verify", "true", "--tensors", "true"])
    text = capsys.readouterr().out
    for part in (f"ZeRO stage {stage}, world size 2", "tok.weight", "head.weight -> tok.weight", "exp_avg_sq",
                 "shard-00001-of-00002.safetensors", "verified", "client state: keys ['scheduler', 'step']"):
        assert part in text, f"{part!r} not in:\n{text}"
    main(["export-optimizer", str(directory / "ckpt"), str(directory / "optimizer.pt")])
    state_dict = torch.load(directory / "optimizer.pt", weights_only=True)
    shapes = [m.shape for n, m in expected["masters"].items() if n != "head.weight"]
    assert len(state_dict["state"]) == len(shapes)
    assert sorted(s["exp_avg"].shape for s in state_dict["state"].values()) == sorted(shapes)
    assert [g["weight_decay"] for g in state_dict["param_groups"]] == [0.1, 0.0]
    assert all(float(s["step"]) == 3 for s in state_dict["state"].values())
