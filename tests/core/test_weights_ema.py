"""The sharded moving average of the weights (``weights_ema_decay``, zero_core/optim/weights_ema.py).

Against DDP + torch's ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated after every step, on 2
ranks at stages 1-3 (fp32; stage 3 also with CPU offload): the average swapped in by ``engine.ema_weights()``, the trained weights back after
it, 1/N of the masters per rank; at stage 3 also the 16-bit export of the average, a checkpoint round trip
that reshards (loaded at stage 2 on the same ranks, then on one rank) and resumes exactly, and offline
consolidation of the average (``zero-checkpoint consolidate --weights_ema``) against the one the engine held.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import zero_core
from distributed import run_distributed
from models import OddMLP, mlp_batch
from stage3_support import full_params, max_abs_diff

DECAY, STEPS, LR = 0.8, 4, 1e-2
TOL = 1e-5


# (label, stage, extra config); the last run is exported and checkpointed
RUNS = [("1", 1, {}), ("2", 2, {}), ("3 cpu offload", 3, {"offload_optimizer": {"device": "cpu"}}),
        ("3", 3, {"stage3_gather_16bit_weights_on_model_save": True})]


def config(stage: int, **extra) -> dict:
    return {"stage": stage, "weights_ema_decay": DECAY, "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 300, **extra}


def loss_of(model, rank: int, step: int) -> torch.Tensor:
    return model(*mlp_batch(rank, step, 0))


def ddp_reference(rank: int, steps: int) -> tuple[dict, dict]:
    """(trained weights, their moving average) after ``steps`` steps of DDP with AveragedModel."""
    torch.manual_seed(0)
    model = OddMLP()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    for step in range(steps):
        loss_of(ddp, rank, step).backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update_parameters(model)
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in average.module.named_parameters()})


def zero_run(stage: int, rank: int, **extra):
    torch.manual_seed(0)
    model = OddMLP()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=LR), config(stage, **extra))
    return model, engine


def train(model, engine, rank: int, steps) -> None:
    for step in steps:
        engine.backward(loss_of(model, rank, step))
        engine.step()


def averaged(model, engine) -> dict:
    with engine.ema_weights():
        return full_params(model)


def worker(rank: int, world_size: int, directory: str) -> dict:
    trained, reference = ddp_reference(rank, STEPS)
    out = {}
    for label, stage, extra in RUNS:
        model, engine = zero_run(stage, rank, **extra)  # cpu offload: the average beside the host masters
        train(model, engine, rank, range(STEPS))
        masters = sum(m.numel() for part in engine.runtime.parts for m in part.masters)
        average = averaged(model, engine)
        out[label] = {"ema": max_abs_diff(average, reference),
                      "trained_after": max_abs_diff(full_params(model), trained),
                      "ema_numel": sum(t.numel() for t in engine.weights_ema.tensors()), "masters": masters,
                      "ema_bytes": engine.memory_stats()["weights_ema"],
                      "total": sum(p.numel() for p in OddMLP().parameters())}
    engine.save_16bit_model(f"{directory}/export", weights_ema=True)
    engine.save_checkpoint(f"{directory}/ckpt")
    if rank == 0:
        torch.save(reference, f"{directory}/reference.pt")
        torch.save(average, f"{directory}/engine_average.pt")  # the last run's, which the checkpoint holds
    out["trained_after_export"] = max_abs_diff(full_params(model), trained)
    model2, engine2 = zero_run(2, rank)  # another stage: other shard ranges
    engine2.load_checkpoint(f"{directory}/ckpt")
    out["loaded"] = max_abs_diff(averaged(model2, engine2), reference)
    out["loaded_trained"] = max_abs_diff(full_params(model2), trained)
    train(model2, engine2, rank, [STEPS])
    _, reference_next = ddp_reference(rank, STEPS + 1)
    out["resumed"] = max_abs_diff(averaged(model2, engine2), reference_next)
    dist.barrier()
    return out


def one_rank(rank: int, world_size: int, directory: str) -> dict:
    model, engine = zero_run(3, rank)
    engine.load_checkpoint(f"{directory}/ckpt")
    out = {"loaded": max_abs_diff(averaged(model, engine), torch.load(f"{directory}/reference.pt"))}
    plain = OddMLP()
    plain_engine = zero_core.setup(plain, torch.optim.AdamW(plain.parameters()), {"stage": 2})
    try:
        averaged(plain, plain_engine)
    except RuntimeError as error:
        out["off"] = str(error)
    plain_engine.save_checkpoint(f"{directory}/no_average")  # for consolidate --weights_ema: an error
    try:  # torch's AveragedModel copies the model: at stage 3 the error names the engine's average
        AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    except RuntimeError as error:
        out["averaged_model"] = str(error)
    return out


def test_weights_ema_matches_averaged_model_round_trips_and_consolidates(tmp_path):
    from safetensors.torch import load_file

    ranks = run_distributed(worker, 2, str(tmp_path), timeout=150)
    for rank, out in enumerate(ranks):
        for label, _, _ in RUNS:
            result = out[label]
            assert result["ema"] <= TOL, f"rank {rank} stage {label}: EMA differs from AveragedModel: {result}"
            assert result["trained_after"] <= TOL, f"rank {rank} stage {label}: weights not restored: {result}"
            assert result["ema_numel"] == result["masters"] < result["total"], result  # 1/N, beside the masters
            assert result["ema_bytes"] == 4 * result["masters"], result
        assert out["trained_after_export"] <= TOL
        assert out["loaded"] <= TOL and out["loaded_trained"] <= TOL, out
        assert out["resumed"] <= TOL, f"rank {rank}: the resumed average differs: {out['resumed']}"
    reference = torch.load(tmp_path / "reference.pt")
    exported = {}
    for file in (tmp_path / "export").glob("*.safetensors"):
        exported.update(load_file(file))
    assert max_abs_diff({n: exported[n] for n in reference}, reference) <= TOL  # (the export adds the buffer)
    alone = run_distributed(one_rank, 1, str(tmp_path), timeout=60)[0]
    assert alone["loaded"] <= TOL, alone  # saved on 2 ranks, loaded on 1
    assert "weights_ema_decay" in alone.get("off", ""), alone  # ema_weights() without an average: named
    assert "AveragedModel" in alone.get("averaged_model", "") and "weights_ema_decay" in alone["averaged_model"]
    check_offline_consolidation(tmp_path)


def check_offline_consolidation(directory) -> None:
    """``zero-checkpoint consolidate --weights_ema``: the average the stage 3 engine held when it saved, exactly,
    from the checkpoint alone; a checkpoint without an average is refused by name."""
    from safetensors.torch import load_file

    from zero_core.checkpoint import consolidated_state_dict
    from zero_core.checkpoint.cli import main as zero_checkpoint
    from zero_core.checkpoint.format import CheckpointError

    held = torch.load(directory / "engine_average.pt")
    zero_checkpoint(["consolidate", str(directory / "ckpt"), str(directory / "out"), "--weights-ema", "true",
                     "--progress", "false"])
    written = {}
    for file in (directory / "out").glob("*.safetensors"):
        written.update(load_file(file))
    in_memory = consolidated_state_dict(directory / "ckpt", weights_ema=True)
    trained = consolidated_state_dict(directory / "ckpt")
    for name, average in held.items():
        assert torch.equal(written[name], average) and torch.equal(in_memory[name], average), name
    assert max_abs_diff({n: trained[n] for n in held}, held) > 1e-3  # the trained weights are another thing
    with pytest.raises(CheckpointError, match="no moving average of the weights.*weights_ema_decay"):
        consolidated_state_dict(directory / "no_average", weights_ema=True)


def test_weights_ema_with_nvme_offload_is_a_config_error():
    nvme = {"device": "nvme", "nvme_path": "/tmp"}
    with pytest.raises(zero_core.ZeroConfigError, match="weights_ema_decay does not combine .*'nvme'"):
        zero_core.ZeroConfig(stage=2, weights_ema_decay=DECAY, offload_optimizer=nvme)
