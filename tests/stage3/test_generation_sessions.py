"""Generation sessions at stage 3 (zero_core/stage3/generation.py): gathered units kept across decoding steps.

One run of 2 ranks (gloo) trains a tiny Llama one step under ZeRO stage 3 and under DDP, then generates with
ranks stopping at different lengths: HF generate() with the whole model kept (the default budget), with a
budget that holds part of it (synced steps, peak gathered elements within the budget), and a hand-written
decoding loop in ``engine.generation()`` (with a training step inside the session). Tokens are compared with the
DDP model's; afterwards the memory is back to its training level, and training still matches DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zero_core
from distributed import run_distributed
from stage3_support import full_params, max_abs_diff
from test_generation import tiny_llama

CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}


def prompt(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 5 + rank, 9, 17 + 3 * rank]])


def hf_generate(model, rank: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt(rank), max_new_tokens=2 + 5 * rank, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def loop_generate(model, session, rank: int) -> list[int]:
    """Greedy decoding by hand, full recompute per token; a finished rank keeps running forwards."""
    tokens, wanted = prompt(rank), 4 + 2 + 5 * rank
    while not session.all_finished(tokens.shape[1] >= wanted):
        with torch.no_grad():
            logits = model(tokens).logits
        if tokens.shape[1] < wanted:
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens[0].tolist()


def train(model, optimizer, step: int, rank: int, engine=None) -> None:
    tokens = torch.randint(2, 61, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
    loss = model(tokens, labels=tokens).loss
    if engine is None:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        engine.backward(loss)
        engine.step()


def training_state(runtime) -> tuple:
    gathered = sorted(u.index for u in runtime.units if u.state.value != "sharded")
    guarded = all(type(p).__name__ == "PartitionedParameter" for u in runtime.units for p in u.params)
    return runtime.live_elements, gathered, guarded


def worker(rank: int, world_size: int) -> dict:
    ddp_model = tiny_llama()
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    model = tiny_llama()
    engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), CONFIG)
    runtime = engine.runtime
    train(ddp, ddp_opt, 0, rank)
    train(model, None, 0, rank, engine)
    before = training_state(runtime)
    out = {"reference": hf_generate(ddp_model, rank), "before": before}
    out["kept"] = hf_generate(model, rank)
    out["after_kept"] = training_state(runtime)
    total = sum(u.numel for u in runtime.units)
    budget = total // 2
    runtime.peak_live_elements = runtime.live_elements
    with engine.generation(budget) as session:
        out["partial_local"] = session.local
        out["partial"] = hf_generate(model, rank)
        out["loop"] = loop_generate(model, session, rank)
    out["partial_peak"], out["budget"] = runtime.peak_live_elements, budget
    out["largest"] = max(u.numel for u in runtime.units)
    with zero_core.generation(model) as session:
        out["whole_local"] = session.local
        out["loop_whole"] = loop_generate(model, session, rank)
        train(ddp, ddp_opt, 1, rank)
        train(model, None, 1, rank, engine)  # a step inside the session: the kept copy is gathered again
        out["loop_after_step"] = loop_generate(model, session, rank)
        out["reference_after_step"] = hf_generate(ddp_model, rank)
    out["after"] = training_state(runtime)
    train(ddp, ddp_opt, 2, rank)
    train(model, None, 2, rank, engine)
    out["diff"] = max_abs_diff(full_params(model), {n: p.detach() for n, p in ddp_model.named_parameters()})
    dist.barrier()
    return out


def test_generation_sessions_keep_units_and_match_ddp():
    ranks = run_distributed(worker, 2, timeout=150)
    for rank, out in enumerate(ranks):
        assert len(out["reference"]) == 4 + 2 + 5 * rank  # the ranks stop at different lengths
        for way in ("kept", "partial", "loop", "loop_whole"):
            assert out[way] == out["reference"], f"rank {rank}: {way} tokens differ from DDP's model"
        assert out["whole_local"] and not out["partial_local"]
        assert out["loop_after_step"] == out["reference_after_step"], f"rank {rank}: stale weights after a step"
        # a partial budget: nothing kept pushes a gather past it (a unit in use may stand beside the kept ones)
        assert out["partial_peak"] <= out["budget"] + out["largest"], out
        assert out["after_kept"] == out["before"] and out["after"] == out["before"], "memory not released"
        assert out["before"][0] == 0 and out["before"][2], out["before"]
        assert out["diff"] <= 1e-5, f"rank {rank}: training after generation differs from DDP by {out['diff']}"
