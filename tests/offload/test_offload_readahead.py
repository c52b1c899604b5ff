"""``offload_param: {device: nvme}`` reads parameter shards ahead along the trace (param_swap.py look_ahead).

One spawn of 2 ranks: a chain of layers trained with the shards in the file (read-ahead with ``buffer_count`` at
its minimum, 1, and at 4; without read-ahead, ``aio.overlap_events: false``) ends with exactly the weights of
the engine without offload, and within 1e-5 of DDP's (AdamW). Then one more forward and backward shows, through
the swap's own bookkeeping (no timing), that each layer's read was submitted before the previous layer ran.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_distributed
from zero_core.offload.param_swap import ParamSwap
from reference import train_ddp
from stage3_support import max_abs_diff, train_engine

STEPS = 3
LAYERS = 6
WIDTH = 24


class Chain(nn.Module):
    """LAYERS linear layers run one after another: the trace is the layer order."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def chain_batch(rank: int, step: int, micro: int):
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(8, WIDTH, generator=generator), torch.randn(8, WIDTH, generator=generator)


def config(nvme_dir: str, param: dict | None, overlap: bool = True) -> dict:
    # prefetch_bucket_size 1: no unit is gathered ahead, so only the read-ahead can overlap a layer's compute;
    # max_reuse_distance 0: forward releases each layer, so backward gathers (and reads) them again
    out = {"stage": 3, "param_persistence_threshold": 0, "prefetch_bucket_size": 1, "max_reuse_distance": 0,
           "aio": {"block_size": 512, "queue_depth": 2, "thread_count": 2, "overlap_events": overlap}}
    if param is not None:
        out["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0, **param}
    return out


CASES = {  # name -> (offload_param, overlap_events)
    "buffers=1": ({"buffer_count": 1}, True),
    "buffers=4": ({"buffer_count": 4}, True),
    "no read-ahead": ({"buffer_count": 2}, False),
}


def ahead_of_use(engine) -> tuple[int, int]:
    """Run one forward and backward; count the layers (after the first) whose shard read had been submitted
    when the previous layer's forward began, out of those whose shard is in the file."""
    swap, runtime = engine.runtime.param_swap, engine.runtime
    seen: list[set] = []
    handles = [layer.register_forward_pre_hook(lambda *_: seen.append(set(swap.reading_ahead())))
               for layer in engine.module.layers]  # after setup: these run after the engine's gather
    x, y = chain_batch(engine.topology.rank, 99, 0)
    engine.backward(engine.module(x, y))
    engine.zero_grad()
    for handle in handles:
        handle.remove()
    units = [runtime.unit_of[layer.weight] for layer in engine.module.layers]
    in_file = [i for i in range(1, LAYERS) if units[i].swap is swap]
    return sum(units[i] in seen[i - 1] for i in in_file), len(in_file)


def worker(rank, world_size):
    nvme_dir = tempfile.mkdtemp(prefix=f"zero-readahead-{rank}-")
    ddp = train_ddp(Chain, chain_batch, STEPS, accumulation=1)
    plain, _ = train_engine(Chain, chain_batch, config(nvme_dir, None), STEPS, accumulation=1)
    report = {}
    for name, (param, overlap) in CASES.items():
        result, engine = train_engine(Chain, chain_batch, config(nvme_dir, param, overlap), STEPS, accumulation=1)
        swap = engine.runtime.param_swap
        counters = {k: getattr(swap, k) for k in ("reads_ahead", "reads_with_gather", "reads_waited",
                                                  "reads_issued_ahead", "reads_dropped", "reads_stale",
                                                  "reads_from_write")}
        report[name] = {
            "same_as_plain": all(torch.equal(result.params[n], plain.params[n]) for n in plain.params),
            "ddp_diff": max_abs_diff(result.params, ddp.params),
            "counters": counters,
            "ahead": ahead_of_use(engine),
            "buffers_back": (len(swap._free) + len(swap._ahead) + len(swap._writing) == param["buffer_count"]
                             and not swap._held),
        }
        engine.remove_offload_files()
    report["plain_ddp_diff"] = max_abs_diff(plain.params, ddp.params)
    report["left"] = os.listdir(nvme_dir)
    os.rmdir(nvme_dir)
    return report


@pytest.mark.timeout(300)
def test_param_nvme_read_ahead_matches_and_reads_ahead():
    for rank, report in enumerate(run_distributed(worker, 2, timeout=240)):
        assert report["left"] == [] and report["plain_ddp_diff"] <= 1e-5, report
        for name in CASES:
            r = report[name]
            assert r["same_as_plain"], f"rank {rank} {name}: weights differ from the engine without offload"
            assert r["ddp_diff"] <= 1e-5, f"rank {rank} {name}: max |w - w_ddp| = {r['ddp_diff']:.3g}"
            assert r["buffers_back"], f"rank {rank} {name}: a buffer was not given back"
            ahead, in_file = r["ahead"]
            assert in_file == LAYERS - 1, r
            counters = r["counters"]
            if name == "no read-ahead":
                assert ahead == 0 and counters["reads_ahead"] == counters["reads_issued_ahead"] == 0, r
            else:  # every layer's read was in flight while the layer before it ran
                assert ahead == in_file, f"rank {rank} {name}: {ahead}/{in_file} reads ahead; {counters}"
                # once the trace is recorded (after step 1), every gather but each pass's first reads ahead,
                # in forward and in backward
                # (each layer has two units, weight and bias, in two optimizer groups: 1 buffer reads one ahead)
                per_pass = (LAYERS - 1) * min(2, CASES[name][0]["buffer_count"])
                # (on a loaded machine the write-back of a shard may still be running when its next gather comes:
                # that read takes the write's buffer, without reading the file, instead of a read ahead)
                served = counters["reads_ahead"] + counters["reads_from_write"]
                assert served >= (STEPS - 1) * 2 * per_pass, r


class FakeUnit(SimpleNamespace):
    """What ParamSwap reads of a ParamUnit; hashed by identity, as units are."""

    __hash__ = object.__hash__

    def wait(self) -> None:  # no gather in flight: holding a buffer as ParamSwap.resident does
        pass


def test_stale_and_dropped_reads_ahead(tmp_path):
    """A read ahead of a shard written after it was submitted is not used; a read that needs a buffer while all
    are reading ahead takes the one needed last; a shard held outside a gather with no buffer left is an error."""
    block = SimpleNamespace(nvme_path=str(tmp_path), buffer_count=2, buffer_size=64, pin_memory=False)
    aio = SimpleNamespace(block_size=32, queue_depth=2, thread_count=2, single_submit=False, overlap_events=True)
    values = [torch.full((40,), float(i)) for i in range(3)]
    units = [FakeUnit(shard=v.clone(), module_name=f"m{i}", state=SimpleNamespace(value="sharded"), swap=None,
                      swapped_shard=None) for i, v in enumerate(values)]
    swap = ParamSwap(block, aio, 0, [u.shard for u in units])
    for unit in units:
        swap.adopt(unit)
    swap.look_ahead(units, None, None, False, None)  # m0 and m1 read ahead (two buffers)
    assert swap.reading_ahead() == units[:2]
    swap._write(units[0], torch.full((40,), 7.0)).wait()  # m0 rewritten after its read was submitted
    assert torch.equal(swap.read(units[0]), torch.full((40,), 7.0)) and swap.reads_stale == 1
    assert torch.equal(swap.read(units[2]), values[2]) and swap.reads_dropped == 1  # m1's buffer taken back
    with pytest.raises(RuntimeError, match="buffers are held .*'m0'.*raise buffer_count"):
        swap.read(units[1])  # m0 and m2 hold both buffers outside any gather (their wait() frees nothing)
    swap.release(units[0])
    swap.release(units[2])  # buffers back: the window (m1, still wanted) is read ahead again
    assert swap.reading_ahead() == [units[1]] and torch.equal(swap.read(units[1]), values[1])
    swap.close()
    assert os.listdir(tmp_path) == []
