"""Stages 1 and 2's reduction paths against DistributedDataParallel, at world size 3 (odd shards, padded buckets).

What these cover (grad_reducer.py): stage 1 reduce-scatters each bucket in place into its gradient shard (no
scratch from the pool); the 1/N average rides on the copy or add into the shard instead of a pass over the whole
bucket; stage 2 lends each parameter its slot of the staging bucket (views made once per (bucket, pool buffer))
as .grad during backward, so autograd accumulates there, and takes them back at the bucket's launch (no .grad is
left after a backward); the step's first reduction overwrites the gradient shard and a second backward without
no_sync adds into it. The DDP reference runs in the same processes on the same data.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from distributed import run_distributed
from models import build_model, make_batch
from reference import train_ddp, train_zero

STEPS = 6
WEIGHT_TOLERANCE = 1e-5  # float reordering only
SMALL_BUCKETS = {"reduce_bucket_size": 300, "allgather_bucket_size": 300}
# (stage, accumulation, no_sync, clip, options)
CASES = [
    (1, 1, True, None, SMALL_BUCKETS),
    (1, 2, False, 0.5, {**SMALL_BUCKETS, "overlap_comm": True}),
    (2, 2, False, 0.5, {**SMALL_BUCKETS, "overlap_comm": True}),  # second backward adds into the staging views
    (2, 3, True, None, {**SMALL_BUCKETS, "overlap_comm": False}),
    (2, 1, True, None, {}),  # one bucket for the whole group
]


def _worker(rank, world_size):
    out = []
    for stage, accumulation, no_sync, clip, options in CASES:
        model_fn, data_fn = partial(build_model, "transformer"), partial(make_batch, "transformer")
        reference = train_ddp(model_fn, data_fn, STEPS, accumulation, clip, no_sync)
        result, engine, _ = train_zero(model_fn, data_fn, {"stage": stage, **options}, STEPS, accumulation, clip,
                                       no_sync)
        reducer = engine.runtime.reducer
        # Stage 2 lends each parameter its staging slot as .grad during backward only, except the last bucket's,
        # whose slots in its kept staging buffer stay their .grad: no gradient memory of its own is left after it
        engine.backward(engine.module(*data_fn(rank, STEPS, 0)))
        pool = {t.untyped_storage().data_ptr() for t in engine.runtime.pool.tensors()}
        last = {id(p) for p in engine.runtime.reducer._last.params} if stage == 2 else set()
        grads_left = sum(p.grad is not None and (id(p) not in last or p.grad.untyped_storage().data_ptr() not in pool)
                         for p in engine.module.parameters()) if stage == 2 else 0
        out.append({"grads_left": grads_left,
            "max_dw": max((result.params[n] - reference.params[n]).abs().max().item() for n in reference.params),
            "losses": (result.losses, reference.losses),
            "norms": (result.norms, reference.norms),
            "buckets": len(reducer.order),
            "scratch_bytes": engine.runtime.pool.nbytes(),
            "staging_view_sets": len(reducer._views),
            "pool_buffers": len(engine.runtime.pool._all),
        })
        engine.close()
    return out


@pytest.mark.timeout(300)
def test_reductions_match_ddp_at_three_ranks():
    per_rank = run_distributed(_worker, 3, timeout=240)
    problems = []
    for rank, results in enumerate(per_rank):
        for (stage, accumulation, no_sync, clip, options), r in zip(CASES, results, strict=True):
            label = f"rank {rank} stage {stage} accumulation {accumulation} no_sync {no_sync} {options}"
            if not r["max_dw"] <= WEIGHT_TOLERANCE:
                problems.append(f"{label}: max |w - w_ddp| = {r['max_dw']:.3g}")
            if not torch.allclose(torch.tensor(r["losses"][0]), torch.tensor(r["losses"][1]), rtol=1e-5, atol=1e-7):
                problems.append(f"{label}: losses {r['losses']}")
            if clip is not None and not torch.allclose(torch.tensor(r["norms"][0]), torch.tensor(r["norms"][1]),
                                                       rtol=1e-5):
                problems.append(f"{label}: clip norms {r['norms']}")
            if options and r["buckets"] < 3:
                problems.append(f"{label}: only {r['buckets']} buckets; the case needs several")
            if r["grads_left"]:
                problems.append(f"{label}: {r['grads_left']} parameters kept a gradient of their own after a stage 2 backward")
            if stage == 1 and r["scratch_bytes"]:
                problems.append(f"{label}: stage 1 took {r['scratch_bytes']} scratch bytes; it reduces in place")
            # views are made once per (bucket, pool buffer): bounded, whatever the number of steps (the last
            # bucket makes its own once, last_bucket.py)
            views_made = r["staging_view_sets"] > 0 or r["buckets"] == 1
            if stage == 2 and not (views_made and r["staging_view_sets"] <= (r["buckets"] - 1) * r["pool_buffers"]):
                problems.append(f"{label}: {r['staging_view_sets']} staging view sets for {r['buckets']} buckets "
                                f"and {r['pool_buffers']} pool buffers")
    assert not problems, "\n".join(problems)
