"""The one-step delayed parameter update (``offload_optimizer.delayed_update_after``; offload/delayed_update.py).

Two ranks at stages 1-3 (stage 3 also with ``offload_param: cpu``) train to the weights of a hand-written delayed
reference: plain torch AdamW on one process whose gradient of step s is taken at the weights of one update
earlier than the exact step's (the ZeRO-Offload paper's rule) once the warm-up's exact steps are done, with an LR
that changes every step and clipping. Each step's loss on each rank matches the reference's (so the forward read
the delayed weights); a checkpoint saved mid-run holds the masters after the last step (the update in flight was
waited for) and does not change the run; ``full_state_dict`` and ``close()`` wait for the update in flight, and
after ``close()`` the model holds it (the engine then trains on, the delay starting again). One process: the
update reads gradient buffers of its own (the next backward's copies go into others) and its result is bit for
bit the exact offloaded step's on the same gradients."""

from __future__ import annotations

import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import zero_core
from distributed import run_distributed
from flat_groups import flat_group, set_grads
from models import build_model, make_batch
from reference import make_optimizer, make_scheduler, snapshot
from stage3_support import full_params, max_abs_diff

from zero_core.config import ZeroConfig, ZeroConfigError
from zero_core.offload import OptimizerOffload
from zero_core.replicated.flat_param_group import FlatParamGroup

MODEL = "transformer"
STEPS = 6  # then close(), and AFTER_CLOSE more steps
AFTER_CLOSE = 2
AFTER = 2  # exact steps before the delay
SAVE_AT = 3  # a checkpoint after this step (0-based)
SMALL = {"reduce_bucket_size": 300, "allgather_bucket_size": 300, "param_persistence_threshold": 0}
CLIP = 0.5  # gradient_clipping: active at every step here (the norms are larger)
RUNS = {"stage 1": {"stage": 1}, "stage 2": {"stage": 2}, "stage 3": {"stage": 3},
        "stage 3, offload_param cpu": {"stage": 3, "offload_param": {"device": "cpu"}}}
TOLERANCE = 2e-5


def delayed_reference(steps: int, after, world_size: int, fresh_at: int = -1):
    """Plain AdamW on one process; the gradient of step s (0-based) is taken at W_s while s <= ``after``, then at
    W_{s-1} (W_j: the weights after j updates), except at step ``fresh_at`` (the first after ``close()``, which
    wrote the update in flight into the model): W_s. ``after`` None: every step exact. Returns (W_0..W_steps,
    losses per step per rank)."""
    model, forward = build_model(MODEL), build_model(MODEL)
    optimizer = make_optimizer(model)
    scheduler = make_scheduler(optimizer)
    history, losses = [snapshot(model)], []
    for step in range(steps):
        used = history[step] if after is None or step <= after or step == fresh_at else history[step - 1]
        with torch.no_grad():
            for name, param in forward.named_parameters():
                param.copy_(used[name])
        forward.zero_grad()
        rank_losses = []
        for rank in range(world_size):  # DDP's average: the mean of the ranks' losses
            loss = forward(*make_batch(MODEL, rank, step, 0))
            (loss / world_size).backward()
            rank_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(forward.parameters(), CLIP)
        for param, source in zip(model.parameters(), forward.parameters()):
            param.grad = source.grad.clone()
        optimizer.step()
        scheduler.step()
        history.append(snapshot(model))
        losses.append(rank_losses)
    return history, losses


def delayed_worker(rank, world_size, checkpoint_root):
    results = {}
    for index, (label, run) in enumerate(RUNS.items()):
        config = {**run, **SMALL, "gradient_clipping": CLIP,
                  "offload_optimizer": {"device": "cpu", "delayed_update_after": AFTER}}
        model = build_model(MODEL)
        optimizer = make_optimizer(model)
        scheduler = make_scheduler(optimizer)
        engine = zero_core.setup(model, optimizer, config)
        losses = []
        checkpoint = f"{checkpoint_root}/run{index}"
        for step in range(STEPS):
            loss = engine.module(*make_batch(MODEL, rank, step, 0))
            engine.backward(loss)
            engine.step()
            scheduler.step()
            losses.append(loss.item())
            if step == SAVE_AT:
                engine.save_checkpoint(checkpoint)  # waits for the update in flight; the run goes on as before
        lagging = full_params(engine.module)
        masters = engine.full_state_dict(rank0_only=False)
        delayed = engine._offload.delayed.delayed_steps
        engine.close()
        closed = full_params(engine.module)
        for step in range(STEPS, STEPS + AFTER_CLOSE):  # the engine trains on after close(), delayed again
            loss = engine.module(*make_batch(MODEL, rank, step, 0))
            engine.backward(loss)
            engine.step()
            scheduler.step()
            losses.append(loss.item())
        engine.close()
        after_close = full_params(engine.module)
        fresh = build_model(MODEL)
        loader = zero_core.setup(fresh, make_optimizer(fresh), {"stage": run["stage"], **SMALL})
        loader.load_checkpoint(checkpoint)
        loaded = full_params(loader.module)
        loader.close()
        results[label] = {"losses": losses, "lagging": lagging, "masters": masters, "closed": closed,
                          "loaded": loaded, "delayed_steps": delayed,
                          "after_close": after_close}
        dist.barrier()
    return results


def test_delayed_update_matches_a_hand_written_delayed_reference_at_stages_1_to_3():
    """Clipped by gradient_clipping at every step, with parameter offload too at stage 3."""
    history, reference_losses = delayed_reference(STEPS + AFTER_CLOSE, AFTER, 2, fresh_at=STEPS)
    exact_history, exact_losses = delayed_reference(STEPS, None, 2)
    # The rule is visible at this tolerance: the exact step's losses and weights are far from the delayed ones.
    assert max(abs(a - b) for s, e in zip(reference_losses, exact_losses) for a, b in zip(s, e)) > 100 * TOLERANCE
    assert max_abs_diff(history[STEPS], exact_history[STEPS]) > 100 * TOLERANCE
    with tempfile.TemporaryDirectory(prefix="zero-delayed-") as root:
        ranks = run_distributed(delayed_worker, 2, root, timeout=240)
    for rank, results in enumerate(ranks):
        for run, got in results.items():
            label = f"rank {rank}, {run}"
            assert got["delayed_steps"] == STEPS - AFTER, label
            for step, loss in enumerate(got["losses"]):
                assert abs(loss - reference_losses[step][rank]) <= TOLERANCE, (label, step)
            assert max_abs_diff(got["lagging"], history[STEPS - 1]) <= TOLERANCE, label  # one update behind
            masters = {name: got["masters"][name] for name in history[STEPS]}  # (tied weights once)
            assert max_abs_diff(masters, history[STEPS]) <= TOLERANCE, label  # the update in flight landed
            assert max_abs_diff(got["closed"], history[STEPS]) <= TOLERANCE, label  # close() wrote it in
            assert max_abs_diff(got["loaded"], history[SAVE_AT + 1]) <= TOLERANCE, label  # the save waited for it
            assert max_abs_diff(got["after_close"], history[-1]) <= TOLERANCE, label


# ------------------------------------------------------------------- one process: the gradient buffers

SIZES = [30, 50, 7, 64, 20, 41]
USED = [True, True, False, True, True, True]  # parameter 2 got no gradient: never stepped


def _offload(group: FlatParamGroup, after):
    config = ZeroConfig(stage=2, offload_optimizer={"device": "cpu", "delayed_update_after": after})
    offload = OptimizerOffload([group], config, rank=0)
    optimizer = torch.optim.AdamW(group.masters, lr=1e-2, weight_decay=0.1)
    offload.swapped.bind([optimizer])
    return offload, optimizer


def test_delayed_update_reads_its_own_gradients_while_the_next_backward_copies():
    """The thread is held back until the next backward has overwritten the gradient shards (and, in bf16, copied
    them to the host as buckets are reduced): the update still applies its own step's gradients, bit for bit the
    exact offloaded step's, and the model's shards hold the weights of one step earlier. With no warm-up the
    first update, on the thread, makes the optimizer state."""
    for dtype, after in ((torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 0)):
        reference, group = flat_group(SIZES, 64, dtype), flat_group(SIZES, 64, dtype)
        exact, exact_optimizer = _offload(reference, None)
        offload, optimizer = _offload(group, after)
        # a master is never the model's shard itself, even where that is fp32 host memory
        assert all(m.data_ptr() != s.data_ptr() for m, s in zip(group.master_shards.buckets, group.param_shards()))
        offload.delayed._pool = ThreadPoolExecutor(max_workers=1)  # so that the test can hold the update back
        clip = torch.tensor(0.7)
        set_grads(group, 0)
        offload.grad_reduced(group, None)
        shards_before = [s.clone() for s in reference.param_shards()]
        for step in range(4):
            set_grads(reference, step)
            exact.step(exact_optimizer, [reference], [USED], 0.5, clip)
            reference.write_back_masters()
            release = threading.Event()
            offload.delayed._pool.submit(release.wait)  # the update waits until the next backward has run
            offload.step(optimizer, [group], [USED], 0.5, clip)
            group.write_back_masters()
            offload.forget_grads()
            set_grads(group, step + 1)  # the next backward: new gradients, copied to the host in bf16
            offload.grad_reduced(group, None)
            release.set()
            if step >= after:  # delayed: the model's shards hold the previous step's weights
                assert all(torch.equal(a, b) for a, b in zip(group.param_shards(), shards_before)), (dtype, after, step)
            shards_before = [s.clone() for s in reference.param_shards()]
        offload.settle()
        assert all(torch.equal(a, b) for a, b in zip(group.masters, reference.masters)), (dtype, after)
        for piece, expected in zip(group.masters, reference.masters):
            want = exact_optimizer.state.get(expected, {})
            got = optimizer.state.get(piece, {})
            assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), (dtype, after)
        assert offload.take_unwritten() and offload.delayed.delayed_steps == 4 - after
        offload.close()
        exact.close()


def test_delayed_update_config_errors_name_the_field():
    nvme = {"device": "nvme", "nvme_path": "/nvme", "delayed_update_after": 1}
    with pytest.raises(ZeroConfigError, match=re.escape("offload_optimizer.delayed_update_after needs "
                                                        "zero_optimization.offload_optimizer.device 'cpu'")):
        ZeroConfig(stage=2, offload_optimizer=nvme)
    with pytest.raises(ZeroConfigError, match="delayed_update_after must be null or an int >= 0, got -1"):
        ZeroConfig(stage=2, offload_optimizer={"device": "cpu", "delayed_update_after": -1})
    with pytest.raises(ZeroConfigError, match="weights_ema_decay does not combine with .*delayed_update_after"):
        ZeroConfig(stage=2, weights_ema_decay=0.9, offload_optimizer={"device": "cpu", "delayed_update_after": 0})


def test_copies_issued_at_the_step_call_leave_a_unit_in_the_ranks_common_prefetch():
    """``contracts.update_pending``: ranks that prefetch together (stage 3, world size > 1) leave out a unit whose
    update a thread still makes (the overlapped step: its readiness differs between ranks), not one whose copies
    into the model every rank issued at its step call (the delayed update's, a stream wait on an accelerator)."""
    from zero_core.contracts import update_pending
    from zero_core.offload import delayed_update, overlapped_step

    class Unit:
        update_in_flight = None

    unit = Unit()
    assert not update_pending(unit)
    unit.update_in_flight = overlapped_step.UpdateInFlight(None)
    assert update_pending(unit)
    unit.update_in_flight = delayed_update._Copied(torch.device("cpu"), None)
    assert not update_pending(unit) and unit.update_in_flight.ready()
