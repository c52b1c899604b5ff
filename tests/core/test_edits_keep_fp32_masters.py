"""Editing the 16-bit model (``GatheredParameters`` with a modifier, ``safe_set_full_fp32_param``) changes only the
fp32 masters of the elements it changed; every other master element keeps its fp32 value.

Two ranks train a bf16 model for 2 steps, so that the masters hold values a bf16 copy cannot. Then rank 0 changes
one element of ``0.bias`` inside ``GatheredParameters([0.weight, 0.bias], modifier_rank=0)`` (rank 1 changes
another, which must not survive), and ``safe_set_full_fp32_param`` sets ``1.weight`` to fp32 values. At stage 3
the two parameters of each Linear are one unit, whose masters were all re-read from the bf16 shard before this was
fixed (rounding them); at stages 1-2 every parameter passed to the context was. Checked against the masters read
before the edits: the untouched elements are bit for bit the same, the changed element is the model's new bf16
value, the set weight is exactly the fp32 value given, and the model's bf16 copy is its masters rounded. Also with
the masters in host memory (``offload_optimizer: cpu``) and swapped to a file (``nvme``), and at stage 3 with the
delayed update (stages 2 and 3), whose model lags the masters by one update: an edit there must not set the
untouched masters back to the model's older values (the edit's changes are told from the model's values before it:
stage 3's shard, stages 1-2's parameters copied when a modifier rank is given).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed


CASES = [(1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "nvme"), (2, "cpu, delayed"), (3, "cpu, delayed")]


def _case(rank: int, stage: int, offload: str) -> dict:
    import tempfile

    import zero_core

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    config = {"stage": stage, "bf16": {"enabled": True}, "param_persistence_threshold": 0}
    delayed = offload == "cpu, delayed"
    if offload != "none":  # host masters: bucket views (cpu), or separate pieces swapped to a file (nvme)
        config["offload_optimizer"] = {"device": offload.split(",")[0], "nvme_path": tempfile.mkdtemp(prefix="e-")}
    if delayed:  # the second step is delayed: the model then lags its masters by one update
        config["offload_optimizer"]["delayed_update_after"] = 1
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    params = dict(model.named_parameters())
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.bfloat16)
        engine.backward(engine.module(x).float().square().mean())
        engine.step()
    before = {n: zero_core.safe_get_full_fp32_param(p).clone() for n, p in params.items()}
    with zero_core.GatheredParameters([params["0.weight"], params["0.bias"]], modifier_rank=0):
        with torch.no_grad():
            params["0.bias"][0 if rank == 0 else 1] += 1.0  # only rank 0's change survives
        edited = params["0.bias"][0].float().item() if rank == 0 else None
    holder = [edited]
    dist.broadcast_object_list(holder, src=0)
    value = torch.randn(params["2.weight"].shape, generator=torch.Generator().manual_seed(7))
    zero_core.safe_set_full_fp32_param(params["2.weight"], value)
    after = {n: zero_core.safe_get_full_fp32_param(p) for n, p in params.items()}
    with zero_core.GatheredParameters(list(params.values())):
        model_copy = {n: p.detach().float().clone() for n, p in params.items()}
    out = {
        "fp32 before": all(not torch.equal(v, v.bfloat16().float()) for v in before.values()),
        "untouched": all(torch.equal(after[n], before[n]) for n in ("0.weight", "2.bias")),
        "bias rest": torch.equal(after["0.bias"][1:], before["0.bias"][1:]),
        "bias edited": after["0.bias"][0].item() == holder[0] != before["0.bias"][0].item(),
        "set exactly": torch.equal(after["2.weight"], value),
        "model is masters rounded": all(torch.equal(model_copy[n], after[n].bfloat16().float()) for n in params)
        != delayed,  # (delayed: the model's untouched elements still lag the masters by one update)
    }
    if offload == "nvme":
        engine.remove_offload_files()
    engine.close()
    return out


def _worker(rank: int, world_size: int) -> list:
    return [_case(rank, stage, offload) for stage, offload in CASES]  # one launch: process start-up once


@pytest.fixture(scope="module")
def results() -> list:
    return run_distributed(_worker, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[f"{stage}-{offload}" for stage, offload in CASES])
def test_edits_change_only_the_masters_of_what_they_changed(results, case):
    for rank, per_case in enumerate(results):
        out = per_case[CASES.index(case)]
        assert all(out.values()), (rank, case, out)
