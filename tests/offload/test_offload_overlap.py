"""The offloaded step overlapped with the next forward (``offload_optimizer.overlap_with_forward``;
offload/overlapped_step.py).

Two ranks at stages 1-3 (stage 3 also with persistent units, with ``offload_param: cpu``, and in bf16; stages 2
and 3 with ``device: nvme``, tiles of 64 elements), and one rank at stage 3, train the same steps twice in one
process: with the overlap forced on (it acts only beside an accelerator) and with ``overlap_with_forward: false``
(the inline step). Clipping and an LR scheduler stepped after every ``step()`` are on, with AdamW and full
partitioning. Every loss, every final parameter and every master is bit for bit the inline run's; the thread
took every step after the first (which makes the state inline), its first part was slowed down so that the next
forward cannot have read a stale shard by luck, and each part's update was waited for where its shard is read
(stage 3: the unit's gather in the next forward; stages 1-2: its all-gather after the step). A checkpoint taken
right after a step holds that step's masters. With ``delayed_update_after``, the overlapped warm-up step hands
over to the delayed update, and the run is the delayed update's alone."""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from models import build_model, make_batch
from reference import make_optimizer, make_scheduler
from stage3_support import full_params

from zero_core.offload import overlapped_step

MODEL = "transformer"
STEPS = 4
SMALL = {"reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
RUNS = {"stage 1": {"stage": 1}, "stage 2": {"stage": 2}, "stage 3": {"stage": 3},
        "stage 3, persistent units": {"stage": 3, "param_persistence_threshold": 200},
        "stage 3, offload_param cpu": {"stage": 3, "offload_param": {"device": "cpu"}},
        "stage 3, bf16": {"stage": 3, "bf16": {"enabled": True}},
        "stage 2, nvme": {"stage": 2, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 64},
        "stage 3, nvme, bf16": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 64,
                                "bf16": {"enabled": True}}}


def train(rank: int, config: dict, overlap: bool, checkpoint: str) -> dict:
    model = build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    engine = zero_core.setup(model, optimizer, config)
    engine._offload.overlap = True if overlap else False
    reads = []  # nvme: the tiles read in (each swap_in call)
    swapper = engine._offload.swapper
    if swapper is not None:
        swap_in = swapper.swap_in
        swapper.swap_in = lambda items: (reads.append(1), swap_in(items))[1]
    dtype = torch.bfloat16 if "bf16" in config else torch.float32
    losses = []
    for step in range(STEPS):
        loss = engine.module(*make_batch(MODEL, rank, step, 0, dtype=dtype))
        engine.backward(loss)
        engine.step()
        scheduler.step()
        losses.append(loss.float().item())
        if step == 1:
            engine.save_checkpoint(checkpoint)  # right after an overlapped step: it waits for it
    masters = engine.full_state_dict(rank0_only=False)
    result = {"losses": losses, "params": full_params(engine.module), "masters": masters,
              "overlapped": engine._offload.overlapped.overlapped_steps}
    result["tiles_read"] = len(reads)
    pool = engine._offload.overlapped._pool
    if pool is not None:  # the thread's kernels use one core fewer; the training thread's count is unchanged
        result["threads"] = (torch.get_num_threads(), pool.submit(torch.get_num_threads).result())
    engine.close()
    engine.remove_offload_files()
    fresh = build_model(MODEL)
    loader = zero_core.setup(fresh, make_optimizer(fresh), {**config, "offload_optimizer": None})
    loader.load_checkpoint(checkpoint)
    result["loaded"] = full_params(loader.module)
    loader.close()
    return result


def overlap_worker(rank, world_size, root, only=None):
    waits = []
    wait = overlapped_step.UpdateInFlight.wait
    step_part = overlapped_step.OverlappedStep._step_part

    def counted_wait(handle):
        waits.append(1)
        wait(handle)

    def slow_first_part(self, *args):  # the forward must wait for it, not find it done
        if not self._slowed:
            self._slowed = True
            time.sleep(0.2)
        step_part(self, *args)

    if world_size == 1:
        torch.set_num_threads(2)  # so that the overlapped step's thread has one fewer to show
    overlapped_step.UpdateInFlight.wait = counted_wait
    overlapped_step.OverlappedStep._step_part = slow_first_part
    results = {}
    for index, (label, run) in enumerate(RUNS.items()):
        if only is not None and label not in only:
            continue
        offload = {"device": "cpu", **run.get("offload_optimizer", {})}
        if offload["device"] == "nvme":  # a swap file per rank and run, tiles of 64 elements (several per part)
            offload["nvme_path"] = tempfile.mkdtemp(dir=root)
        config = {**SMALL, **run, "gradient_clipping": 0.5, "offload_optimizer": offload}
        got = {}
        for overlap in (False, True):
            overlapped_step.OverlappedStep._slowed = False
            waits.clear()
            got[overlap] = train(rank, config, overlap, f"{root}/run{index}-{overlap}")
            got[overlap]["waits"] = len(waits)
        results[label] = got
        dist.barrier()
    return results


def test_overlapped_step_equals_the_inline_step_bit_for_bit_at_stages_1_to_3():
    with tempfile.TemporaryDirectory(prefix="zero-overlap-") as root:
        check(run_distributed(overlap_worker, 2, root, timeout=300))


def test_one_rank_prefetches_only_what_has_landed_and_equals_the_inline_step():
    """Alone, a rank's prefetch skips the units whose update is still being written (with others it skips every
    unit with an update pending, the same on every rank): the forward runs while the thread steps the rest."""
    with tempfile.TemporaryDirectory(prefix="zero-overlap-") as root:
        check(run_distributed(overlap_worker, 1, root, ["stage 3", "stage 3, bf16"], timeout=300))


def check(ranks: list) -> None:
    for rank, results in enumerate(ranks):
        for run, got in results.items():
            label = f"rank {rank}, {run}"
            inline, overlapped = got[False], got[True]
            assert inline["overlapped"] == 0 and inline["waits"] == 0, label
            # nvme: the thread reads each part in tiles of sub_group_size as the inline step does (split at the
            # parts' ends too, so at least as many reads), never a whole part at once
            assert overlapped["tiles_read"] >= inline["tiles_read"], (label, overlapped["tiles_read"],
                                                                      inline["tiles_read"])
            if len(ranks) == 1:
                assert overlapped["threads"] == (2, 1), f"{label}: threads (training, step) {overlapped['threads']}"
            assert overlapped["overlapped"] == STEPS - 1, f"{label}: {overlapped['overlapped']} overlapped steps"
            assert overlapped["waits"] >= STEPS - 1, f"{label}: no reader waited for a part's update"
            assert inline["losses"] == overlapped["losses"], (label, inline["losses"], overlapped["losses"])
            for key in ("params", "masters", "loaded"):
                for name, value in inline[key].items():
                    assert torch.equal(value, overlapped[key][name]), f"{label}: {key} {name} differs"
            start = build_model(MODEL).state_dict()
            changed = [name for name, value in inline["params"].items()
                       if name in start and not torch.equal(value.float(), start[name].float())]
            assert changed, f"{label}: the reference run did not train"


def delayed_worker(rank, world_size):
    """The overlapped step during the delayed update's warm-up (both on a GPU by default), then the delayed update:
    the run is the delayed update's without the overlap, bit for bit."""
    out = {}
    for stage in (2, 3):
        runs = {}
        for overlap in (False, True):
            model = build_model(MODEL)
            engine = zero_core.setup(model, make_optimizer(model), {
                **SMALL, "stage": stage, "offload_optimizer": {"device": "cpu", "delayed_update_after": 2}})
            engine._offload.overlap = overlap
            losses = []
            for step in range(STEPS + 2):
                loss = engine.module(*make_batch(MODEL, rank, step, 0))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            engine.close()  # lands the update in flight
            runs[overlap] = (losses, full_params(engine.module), engine._offload.overlapped.overlapped_steps)
        out[stage] = runs
    return out


def test_the_overlap_hands_over_to_the_delayed_update_after_its_warm_up():
    (out,) = run_distributed(delayed_worker, 1, timeout=200)
    for stage, runs in out.items():
        (plain_losses, plain, plain_count), (losses, params, count) = runs[False], runs[True]
        assert plain_count == 0 and count == 1, (stage, plain_count, count)  # step 2 (step 1 makes the state)
        assert losses == plain_losses, (stage, losses, plain_losses)
        for name, value in plain.items():
            assert torch.equal(value, params[name]), (stage, name)


def default_worker(rank, world_size):
    """What ``overlap_with_forward`` resolves to at each stage and device (engine._offload.overlap: None is on
    where the shards are on an accelerator, False off)."""
    out = {}
    for stage in (1, 2, 3):
        for block in ({"device": "cpu"}, {"device": "cpu", "overlap_with_forward": True},
                      {"device": "cpu", "overlap_with_forward": False}):
            model = build_model(MODEL)
            engine = zero_core.setup(model, make_optimizer(model), {**SMALL, "stage": stage,
                                                                    "offload_optimizer": block})
            out[(stage, block.get("overlap_with_forward"))] = engine._offload.overlap
            engine.close()
    return out


def test_the_default_overlaps_at_stage_3_only():
    """null: on at stage 3 (the next forward waits per unit); off at stages 1-2, whose step call all-gathers every
    group after the step (nothing could overlap, and the inline step writes back beside its chunks); true and
    false as asked at every stage."""
    (out,) = run_distributed(default_worker, 1, timeout=200)
    for stage in (1, 2, 3):
        assert out[(stage, None)] == (None if stage == 3 else False), (stage, out[(stage, None)])
        assert out[(stage, True)] is None and out[(stage, False)] is False, stage
