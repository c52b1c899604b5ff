"""Activation checkpoints through the engine: the ``activation_checkpointing`` block and
``zero_core.checkpointing.checkpoint`` (DeepSpeed's ``deepspeed.checkpointing.checkpoint``).

Each honoured field trains at stage 3 (2 ranks, AdamW, full partitioning) to the weights DDP gives with plain
``torch.utils.checkpoint``, and does what it says (inputs kept in host memory, in one buffer's slots, partitioned
over a model-parallel group, boundaries synchronized: the counters of ``zero_core.checkpointing.current()``).
Hugging Face's ``gradient_checkpointing_enable()`` trains at stage 3 to DDP's weights, plain and routed through
``cpu_checkpointing``. ``profile`` times each checkpointed forward and recomputation, and rank 0 logs one line
per pass; ``partition_activations`` without a model-parallel group is an error naming that need."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import zero_core
from zero_core import checkpointing
from distributed import run_distributed
from init_safety_models import GPT2LM
from models import BATCH, D_MODEL, SEQ, TinyTransformer, transformer_batch
from reference import train_ddp
from stage3_support import CheckpointedTransformer, capture, max_abs_diff, train_engine, unwrap

STEPS = 3
TOL = 2e-5
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
# Each honoured field (and a combination), as a DeepSpeed activation_checkpointing block.
BLOCKS = {
    "cpu": {"cpu_checkpointing": True},
    "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": 2},
    "cpu+contiguous": {"cpu_checkpointing": True, "contiguous_memory_optimization": True, "number_checkpoints": 2},
    "synchronize": {"synchronize_checkpoint_boundary": True},
    "profile+cpu": {"profile": True, "cpu_checkpointing": True},
}


class EngineCheckpointedTransformer(TinyTransformer):
    """TinyTransformer whose blocks run under zero_core.checkpointing.checkpoint."""

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = checkpointing.checkpoint(block, x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class CheckpointedGPT2(GPT2LM):
    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.lm.gradient_checkpointing_enable()


def _whole(block: dict) -> dict:
    return {"zero_optimization": ZERO3, "activation_checkpointing": block}


def _fields_section(rank):
    """Each block at stage 3 against DDP with torch.utils.checkpoint: weight difference and counters."""
    reference = train_ddp(CheckpointedTransformer, transformer_batch, STEPS).params
    out = {}
    for name, block in BLOCKS.items():
        with _logged("zero_core.checkpointing") as lines:
            result, engine = train_engine(EngineCheckpointedTransformer, transformer_batch, _whole(block), STEPS)
            last = checkpointing.log_profile()  # the last pass's timings (the others were logged as they ended)
        stats = checkpointing.current().stats
        out[name] = {"diff": max_abs_diff(result.params, reference), "stats": vars(stats).copy(), "lines": lines,
                     "last": None if last is None else vars(last).copy()}
        engine.close()
    return out


@contextlib.contextmanager
def _logged(name: str):
    """The messages logger ``name`` emits at INFO inside the block."""
    lines, logger = [], logging.getLogger(name)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _error_section(rank):
    """partition_activations with no model-parallel group given: setup raises, naming the need."""
    model = EngineCheckpointedTransformer()
    try:
        zero_core.setup(model, torch.optim.AdamW(model.parameters()), _whole({"partition_activations": True}))
    except ValueError as error:
        return str(error)
    return None


def _partition_section(rank):
    """Two-way model parallelism (the ranks hold the same activations) and data parallelism of one rank each:
    stage 3 on each rank's own group, the checkpointed inputs partitioned over both ranks, against a plain run of
    torch.utils.checkpoint on the same batches."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    checkpointing.configure(mpu_=dist.group.WORLD)  # the model-parallel group: both ranks
    batches = [transformer_batch(0, step, 0) for step in range(STEPS)]  # the same data on both ranks
    plain = CheckpointedTransformer()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    for batch in batches:
        plain(*batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {}
    for name, block in {"partition": {"partition_activations": True},
                        "partition+cpu+contiguous": {"partition_activations": True, "cpu_checkpointing": True,
                                                     "contiguous_memory_optimization": True,
                                                     "number_checkpoints": 2}}.items():
        model = EngineCheckpointedTransformer()
        engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3), _whole(block),
                                 process_group=singles[rank])
        for batch in batches:
            engine.backward(model(*batch))
            engine.step()
        stats = vars(checkpointing.current().stats).copy()
        with zero_core.GatheredParameters(list(model.parameters())):
            diff = max_abs_diff({n: p.detach().clone() for n, p in model.named_parameters()},
                                {n: p.detach() for n, p in plain.named_parameters()})
        out[name] = {"diff": diff, "stats": stats}
        engine.close()
    return out


def _hf_section(rank):
    """Hugging Face gradient checkpointing at stage 3 against DDP (both with gradient_checkpointing_enable()),
    plain and with cpu_checkpointing routed through zero_core.checkpointing."""
    reference = train_ddp(CheckpointedGPT2, transformer_batch, STEPS).params
    out = {}
    for name, block in {"plain": {}, "cpu": {"cpu_checkpointing": True}}.items():
        result, engine = train_engine(CheckpointedGPT2, transformer_batch, _whole(block), STEPS)
        out[name] = {"diff": max_abs_diff(result.params, reference),
                     "stashed": checkpointing.current().stats.stashed}
        engine.close()
    return out


def checkpoints_worker(rank, world_size):
    sections = {"error": _error_section, "fields": _fields_section, "hf": _hf_section,
                "partition": _partition_section}
    return {name: capture(fn, rank) for name, fn in sections.items()}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(checkpoints_worker, 2, timeout=170)


def _section(ranks, name):
    return [unwrap(found[name]) for found in ranks]


@pytest.mark.timeout(220)
def test_each_field_trains_to_ddp_with_torch_checkpoint(ranks):
    for found in _section(ranks, "fields"):
        for name, run in found.items():
            assert run["diff"] < TOL, (name, run)
        per_step = 2  # two checkpointed blocks per forward
        cpu, contiguous = found["cpu"]["stats"], found["contiguous"]["stats"]
        assert cpu["stashed"] == cpu["restored"] == STEPS * per_step and cpu["host_bytes"] == cpu["stashed_bytes"] > 0
        # Two slots, allocated once and reused every step.
        assert contiguous["slots_taken"] == STEPS * per_step and contiguous["buffer_bytes"] > 0
        assert found["cpu+contiguous"]["stats"]["host_bytes"] > 0
        assert found["synchronize"]["stats"]["synchronized"] >= 2 * STEPS * per_step
        assert found["synchronize"]["stats"]["stashed"] == 0  # torch keeps the inputs: nothing else to do


@pytest.mark.timeout(220)
def test_profile_times_forwards_and_recomputations_and_rank_0_logs_each_pass(ranks):
    for rank, found in enumerate(_section(ranks, "fields")):
        profiled = found["profile+cpu"]
        assert profiled["diff"] < TOL and profiled["stats"]["stashed"] == STEPS * 2  # composes with cpu_checkpointing
        last = profiled["last"]
        assert last["forwards"] == last["recomputations"] == 2 and last["forward_s"] > 0 and last["recompute_s"] > 0
        lines = profiled["lines"]
        assert len(lines) == (STEPS if rank == 0 else 0), lines  # one line per forward-backward pass, rank 0 only
        assert all(line.startswith("activation checkpoints: 2 forwards ") and "2 recomputations" in line
                   for line in lines), lines
        assert found["cpu"]["last"] is None and found["cpu"]["lines"] == []  # off unless asked for


@pytest.mark.timeout(220)
def test_partition_activations_over_a_model_parallel_group(ranks):
    for found in _section(ranks, "partition"):
        for name, run in found.items():
            assert run["diff"] < TOL, (name, run)
            stats = run["stats"]
            half = -(-BATCH * SEQ * D_MODEL // 2) * 4  # each rank keeps half of every checkpointed input
            assert stats["stashed"] == stats["restored"] == STEPS * 2 and stats["stashed_bytes"] == STEPS * 2 * half
        assert found["partition+cpu+contiguous"]["stats"]["host_bytes"] == found["partition"]["stats"]["stashed_bytes"]


@pytest.mark.timeout(220)
def test_partition_activations_without_a_group_is_an_error(ranks):
    for message in _section(ranks, "error"):
        assert message is not None and "partition_activations needs a model-parallel group" in message
        assert "configure(mpu_=" in message and "pure data parallelism" in message


@pytest.mark.timeout(220)
def test_hf_gradient_checkpointing_trains_at_stage_3(ranks):
    for found in _section(ranks, "hf"):
        assert found["plain"]["diff"] < TOL and found["cpu"]["diff"] < TOL, found
        assert found["plain"]["stashed"] == 0 and found["cpu"]["stashed"] >= STEPS * 2  # two GPT-2 blocks


def test_profile_is_honoured_not_warned():
    config = zero_core.ZeroConfig.from_dict(_whole({"profile": True, "cpu_checkpointing": True}))
    assert config.unimplemented_fields() == ()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpointing.configure(profile=True).active
    assert [str(w.message) for w in caught] == []
    checkpointing.configure()


def test_contiguous_needs_number_checkpoints():
    with pytest.raises(zero_core.ZeroConfigError, match="number_checkpoints"):
        zero_core.ZeroConfig.from_dict(_whole({"contiguous_memory_optimization": True}))


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_gradients_and_dropout_equal_torch_checkpoint(name):
    """One process: each field gives torch.utils.checkpoint's gradients, dropout's recomputed masks included."""
    block = BLOCKS[name]
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh()) for _ in range(2)])
    x = torch.randn(8, 16, requires_grad=True)

    def grads(fn):
        layers.zero_grad()
        x.grad = None
        torch.manual_seed(1)
        h = x
        for layer in layers:
            h = fn(layer, h)
        h.square().sum().backward()
        return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]

    expected = grads(lambda layer, h: torch_checkpoint.checkpoint(layer, h, use_reentrant=False))
    checkpointing.configure(deepspeed_config=_whole(block))
    try:
        for got, want in zip(grads(checkpointing.checkpoint), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        checkpointing.configure()


def test_contiguous_overflow_names_the_fix():
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=1)
    try:
        layer = nn.Linear(4, 4)
        h = torch.randn(2, 4, requires_grad=True)
        h = checkpointing.checkpoint(layer, h)
        with pytest.raises(ValueError, match="number_checkpoints=1"):
            checkpointing.checkpoint(layer, h)
    finally:
        checkpointing.reset()
        checkpointing.configure()


def test_forwards_without_backward_give_their_slots_back():
    """Evaluation with gradients on: each dropped graph frees its stashes and contiguous slots."""
    checkpointing.configure(checkpoint_in_cpu=True, contiguous_checkpointing=True, num_checkpoints=2)
    try:
        layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        for _ in range(3):  # more checkpoints than slots in all
            h = torch.randn(2, 4, requires_grad=True)
            for layer in layers:
                h = checkpointing.checkpoint(layer, h)
            del h
        assert checkpointing.current().stats.slots_taken == 6
        assert not [ref for ref in checkpointing.current().pending if ref() is not None]
    finally:
        checkpointing.configure()


def test_configure_reads_deepspeeds_mpu_and_rejects_other_objects():
    from zero_core.checkpointing.settings import _group_of

    class Mpu:  # what Megatron-style code passes to deepspeed.checkpointing.configure
        def get_model_parallel_group(self):
            return "the tensor-parallel group"

    assert _group_of(Mpu()) == "the tensor-parallel group"
    with pytest.raises(TypeError, match="get_model_parallel_group"):
        checkpointing.configure(mpu_=object())


def test_accelerate_zero_yaml_takes_the_block_inside_zero_optimization(tmp_path):
    from accelerate_zero.launch_config import read_launch_config

    inside = tmp_path / "inside.yaml"
    inside.write_text("distributed_type: 'NO'\nzero_optimization:\n  stage: 3\n"
                      "  activation_checkpointing: {cpu_checkpointing: true}\n")
    read_launch_config(inside)
    outside = tmp_path / "outside.yaml"
    outside.write_text("distributed_type: 'NO'\nzero_optimization: {stage: 3}\n"
                       "activation_checkpointing: {cpu_checkpointing: true}\n")
    with pytest.raises(zero_core.ZeroConfigError, match="move it inside the 'zero_optimization:' block"):
        read_launch_config(outside)


def test_cpu_checkpointing_holds_each_input_only_in_its_stash_until_its_recomputation():
    """What the GPU peak depends on, on the CPU path: after forward no block's input is held but in its stash
    (torch's checkpoint keeps each one), and in backward each stash is freed once its block's backward is over,
    so at each recomputation only the stashes of the blocks still to come are alive."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(4)])

    def run(fn):
        inputs, live_at_recomputation = [], []
        recomputing = [False]

        def pre_hook(module, args):
            if recomputing[0]:
                live_at_recomputation.append([not ref.expired() for ref in kept])
            else:
                inputs.append(StorageWeakRef(args[0].untyped_storage()))

        handles = [block.register_forward_pre_hook(pre_hook) for block in blocks]
        try:
            h = torch.randn(8, 16, requires_grad=True)
            for block in blocks:
                h = h + fn(block, h)
            loss = h.square().sum()
            del h
            kept = [StorageWeakRef(ref().kept[0].untyped_storage()) for ref in checkpointing.current().pending]
            held = [not ref.expired() for ref in inputs[1:]]  # the first is the caller's
            recomputing[0] = True
            loss.backward()
        finally:
            for handle in handles:
                handle.remove()
        return held, live_at_recomputation

    held, _ = run(lambda block, h: torch_checkpoint.checkpoint(block, h, use_reentrant=False))
    assert held == [True, True, True]  # torch keeps them: the contrast
    checkpointing.configure(checkpoint_in_cpu=True)
    try:
        held, live = run(checkpointing.checkpoint)
        assert held == [False, False, False]
        assert live == [[True] * 4, [True] * 3 + [False], [True] * 2 + [False] * 2, [True] + [False] * 3]
        assert checkpointing.current().stats.restored == 4
    finally:
        checkpointing.configure()
