"""Pretrained weights straight into the shards: each rank reads only its own elements, the result is exact.

Every case runs at 3 ranks (shards of uneven sizes, padding on the last rank) against the same weights loaded
the ordinary way in the same process: ``from_pretrained`` without the engine for Hugging Face models, the file's
tensors for ``zero_core.load_pretrained``.
"""

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import zero_core
from distributed import run_distributed
from zero_core.checkpoint.format import CheckpointMismatchError
from zero_core.layout import Range
from zero_core.pretrained import private_pages, rank0_reads
from zero_core.pretrained.files import WeightFiles

WORLD = 3
FULLY_PARTITIONED = {"stage": 3, "stage3_param_persistence_threshold": 0}  # small test models would stay whole


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with zero_core.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def count_reads(monkeypatch_target=WeightFiles) -> dict:
    """Elements this rank reads from weight files: WeightFiles.read_into reads values, WeightFiles._view maps
    them (a copy-on-write view of the file: its pages are read when first touched); nothing else does either."""
    counter = {"elements": 0, "mapped": 0}
    read_into, view = monkeypatch_target.read_into, monkeypatch_target._view

    def counted_read_into(self, key, rng, out):
        counter["elements"] += rng.size
        return read_into(self, key, rng, out)

    def counted_view(self, key, rng):
        counter["elements"] += rng.size
        counter["mapped"] += rng.size
        return view(self, key, rng)

    monkeypatch_target.read_into, monkeypatch_target._view = counted_read_into, counted_view
    return counter


class Net(nn.Module):
    """Odd sizes, a bias, a buffer and a tied head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 11)
        self.body = nn.Linear(11, 13)
        self.norm = nn.LayerNorm(13)
        self.head = nn.Linear(11, 37, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))


def _hf_models(rank: int, world: int, tmp: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    class KeepHeadFp32(LlamaForCausalLM):
        _keep_in_fp32_modules = ["lm_head"]

    results = {}
    reads = count_reads()
    for name, kwargs, cls, rank0 in [("untied", {}, AutoModelForCausalLM, False),
                                     ("tied", {}, AutoModelForCausalLM, False),
                                     ("untied", {"dtype": torch.bfloat16}, AutoModelForCausalLM, False),
                                     ("untied", {"dtype": torch.float16}, KeepHeadFp32, False),
                                     ("extra_and_missing", {}, AutoModelForCausalLM, False),
                                     ("untied", {"dtype": torch.bfloat16}, AutoModelForCausalLM, True)]:
        path = Path(tmp) / name
        reads["elements"] = reads["mapped"] = 0
        with zero_core.Init(config={"stage": 3}, rank0_reads=rank0):
            model, info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
        read, mapped = reads["elements"], reads["mapped"]
        reference, ref_info = cls.from_pretrained(path, output_loading_info=True, **kwargs)
        ours, theirs = gathered(model), dict(reference.named_parameters())
        assert all(zero_core.is_partitioned(p) for p in model.parameters())
        assert sorted(ours) == sorted(theirs)
        for key, value in ours.items():
            assert value.dtype == theirs[key].dtype, (name, key, value.dtype, theirs[key].dtype)
            # a key the files lack is initialised afresh, from other random numbers than the reference's
            assert torch.equal(value, theirs[key]) or key in ref_info["missing_keys"], (name, key)
        assert {k: sorted(map(str, v)) for k, v in info.items()} == {k: sorted(map(str, v)) for k, v in ref_info.items()}
        total = sum(p.numel() for p in reference.parameters())
        case = f"{name}-{cls.__name__}-{kwargs.get('dtype')}" + ("-rank0_reads" if rank0 else "")
        results[case] = {"read": read, "mapped": mapped, "total": total}
        if name == "tied":
            assert model.lm_head.weight is model.model.embed_tokens.weight
            # and it trains from there: one stage-3 step gives the reference's loss
            ids = torch.arange(24).view(2, 12) % 96
            expected_loss = reference(input_ids=ids, labels=ids).loss.item()
            del reference, theirs  # the reference's parameters map the files
            engine = zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), FULLY_PARTITIONED)
            gc.collect()
            # shards that were views of the files are gone: the engine holds its own copies, the files may change
            assert not [line for line in open("/proc/self/maps") if str(path) in line]
            loss = model(input_ids=ids, labels=ids).loss
            assert abs(loss.item() - expected_loss) <= 1e-6
            engine.close()
    return results


def test_from_pretrained_under_init_reads_only_each_ranks_share_and_loads_exactly(tmp_path):
    from pretrained_files import save_tiny_llama

    save_tiny_llama(tmp_path / "untied", tied=False, shard_size="30KB")
    save_tiny_llama(tmp_path / "tied", tied=True)
    save_tiny_llama(tmp_path / "extra_and_missing", tied=False)
    _add_extra_and_drop_one(tmp_path / "extra_and_missing")
    results = run_distributed(_hf_models, WORLD, str(tmp_path), timeout=240)
    for rank, rank_results in enumerate(results):
        for case, seen in rank_results.items():
            if case.endswith("rank0_reads"):  # rank 0 reads everything (buffers too), the others nothing
                assert (seen["read"] >= seen["total"]) if rank == 0 else seen["read"] == 0, (case, seen)
            else:  # each rank's share, plus at most a row of each tensor on either side of it
                assert seen["read"] <= seen["total"] / WORLD * 1.15, (case, seen)
    for case in results[0]:
        if not case.endswith("rank0_reads"):
            total = results[0][case]["total"]
            assert abs(sum(r[case]["read"] for r in results) - total) <= 0.1 * total
    # shards of the file's dtype and unpadded are views of the file (96 x 32 splits in 3); a cast is read
    assert results[0]["untied-AutoModelForCausalLM-None"]["mapped"] > 0
    assert all(r["untied-AutoModelForCausalLM-torch.bfloat16"]["mapped"] == 0 for r in results)


def _add_extra_and_drop_one(path: Path) -> None:
    """One tensor the model does not have, and one it has that the files lack: both in the loading report."""
    import json

    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    dropped = "model.layers.1.mlp.up_proj.weight"
    file = path / index["weight_map"].pop(dropped)
    tensors = load_file(file)
    tensors.pop(dropped)
    tensors["model.unused.weight"] = torch.ones(3)
    index["weight_map"]["model.unused.weight"] = file.name
    save_file(tensors, file, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _load_pretrained_cases(rank: int, world: int, tmp: str) -> dict:
    tmp = Path(tmp)
    expected = torch.load(tmp / "expected.pt", weights_only=True)
    reads = count_reads()
    out = {}

    # built under Init: each rank overwrites its own shard, no collective
    with zero_core.Init(config={"stage": 3}):
        torch.manual_seed(100 + rank)
        model = Net()
    result = zero_core.load_pretrained(model, tmp / "net")
    out["init"] = reads["elements"]
    assert result == ([], [])
    _equal(gathered(model), expected)
    assert torch.equal(model.scale, expected["scale"])

    # on the meta device: comes out partitioned, never whole here
    reads["elements"] = 0
    with torch.device("meta"):
        meta = Net()
    zero_core.load_pretrained(meta, tmp / "net" / "pytorch_model.bin")
    out["meta"] = reads["elements"]
    assert all(zero_core.is_partitioned(p) for p in meta.parameters()) and meta.head.weight is meta.emb.weight
    _equal(gathered(meta), expected)

    # rank 0 reads, the others only receive: every shard in one scatter, then through a bucket of 7 elements
    # per rank (shards cut in pieces, pieces of several parameters in one scatter)
    reads["elements"] = 0
    for bucket_bytes in (rank0_reads.RANK0_BUCKET_BYTES, 7 * 4 * world):
        with zero_core.Init(config={"stage": 3}, rank0_reads=True) as init:
            model0 = Net()
        scatters = init.comm.stats().get("scatter", {}).get("calls", 0)
        default, rank0_reads.RANK0_BUCKET_BYTES = rank0_reads.RANK0_BUCKET_BYTES, bucket_bytes
        try:
            zero_core.load_pretrained(model0, tmp / "net")
        finally:
            rank0_reads.RANK0_BUCKET_BYTES = default
        _equal(gathered(model0), expected)
        out.setdefault("scatters", []).append(init.comm.stats()["scatter"]["calls"] - scatters)
    out["rank0"] = reads["elements"]

    # plain load_state_dict into a model built under Init
    with zero_core.Init(config={"stage": 3}):
        plain_under_init = Net()
    plain_under_init.load_state_dict(expected, strict=False)  # the tied head is stored once
    _equal(gathered(plain_under_init), expected)

    # under an engine: the fp32 masters take the weights
    with zero_core.Init(config={"stage": 3}):
        trained = Net()
    engine = zero_core.setup(trained, torch.optim.AdamW(trained.parameters()), FULLY_PARTITIONED)
    zero_core.load_pretrained(trained, tmp / "net")
    _equal({n: zero_core.safe_get_full_fp32_param(p) for n, p in trained.named_parameters()}, expected)
    engine.close()

    # bad input changes nothing, and every rank raises the same error
    with zero_core.Init(config={"stage": 3}):
        victim = Net()
    before = gathered(victim)
    for bad, message in [("wrong_shape", "shape mismatch for 'body.weight': file (13, 12), model (13, 11)"),
                         ("missing_one", "missing from the weight files: ['norm.bias']")]:
        with pytest.raises(CheckpointMismatchError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            zero_core.load_pretrained(victim, tmp / bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"truncated: it has \d+ bytes, but tensor '\w+' ends at byte"):
        zero_core.load_pretrained(victim, tmp / "truncated" / "model.safetensors")
    _equal(gathered(victim), before)
    with pytest.warns(UserWarning, match="missing from the weight files"):
        result = zero_core.load_pretrained(victim, tmp / "missing_one" / "model.safetensors", strict=False)
    assert result.missing_keys == ["norm.bias"]
    with pytest.raises(TypeError, match=r"first argument \(module\) is the model to partition.*config=\{'stage': 3\}"):
        zero_core.Init({"stage": 3})
    return out


def _equal(ours: dict, expected: dict) -> None:
    for name, value in ours.items():
        assert torch.equal(value, expected[name]), name


def test_load_pretrained_into_init_meta_engine_and_plain_models(tmp_path):
    torch.manual_seed(7)
    net = Net()
    state = {k: v.clone() for k, v in net.state_dict().items() if k != "head.weight"}  # tied: stored once
    torch.save(state, tmp_path / "expected.pt")
    (tmp_path / "net").mkdir()
    save_file(state, tmp_path / "net" / "model.safetensors")
    torch.save(state, tmp_path / "net" / "pytorch_model.bin")
    for bad, change in [("wrong_shape", lambda s: s.update({"body.weight": torch.zeros(13, 12)})),
                        ("missing_one", lambda s: s.pop("norm.bias"))]:
        (tmp_path / bad).mkdir()
        altered = dict(state)
        change(altered)
        save_file(altered, tmp_path / bad / "model.safetensors")
    (tmp_path / "truncated").mkdir()
    whole = (tmp_path / "net" / "model.safetensors").read_bytes()
    (tmp_path / "truncated" / "model.safetensors").write_bytes(whole[: len(whole) - 8])
    results = run_distributed(_load_pretrained_cases, WORLD, str(tmp_path), timeout=180)
    total = sum(v.numel() for k, v in state.items() if k != "scale")
    for rank, seen in enumerate(results):
        assert seen["init"] <= total / WORLD * 1.3 + 2 and seen["meta"] <= total / WORLD * 1.3 + 2, seen
        assert (seen["rank0"] > 0) == (rank == 0), seen
        shard_elements = sum(-(-v.numel() // WORLD) for k, v in state.items() if k != "scale")
        assert seen["scatters"] == [1, -(-shard_elements // 7)], seen


def test_shards_are_private_views_of_the_file_where_nothing_is_converted_or_padded(tmp_path):
    values = torch.arange(24, dtype=torch.float32)
    save_file({"w": values}, tmp_path / "model.safetensors")
    before = (tmp_path / "model.safetensors").read_bytes()
    live = private_pages.live_mappings()
    with WeightFiles.open(tmp_path) as files:
        mapped = files.shard("w", Range(8, 16), 8, torch.float32, torch.device("cpu"))
        padded = files.shard("w", Range(16, 24), 10, torch.float32, torch.device("cpu"))
        cast = files.shard("w", Range(0, 8), 8, torch.float64, torch.device("cpu"))
    assert torch.equal(mapped, values[8:16]) and torch.equal(cast, values[:8].double())
    assert torch.equal(padded, torch.cat([values[16:], torch.zeros(2)]))
    assert private_pages.live_mappings() == live + 1  # the one range that needed neither a cast nor padding
    mapped.mul_(-1)  # copy-on-write: the file keeps its bytes, and the view outlives the closed files
    assert torch.equal(mapped, -values[8:16]) and (tmp_path / "model.safetensors").read_bytes() == before
    del mapped
    gc.collect()
    assert private_pages.live_mappings() == live  # unmapped with its last view


def test_reads_stage_on_the_host_whatever_the_default_device(tmp_path):
    """Under ``with torch.device("cuda")`` (a GPU run) the staging buffer of a cast read must still be host memory:
    the default device stands in here as "meta" (a read into it would fail)."""
    values = torch.arange(40, dtype=torch.float32).view(8, 5)
    save_file({"w": values.to(torch.bfloat16)}, tmp_path / "model.safetensors")
    with WeightFiles.open(tmp_path) as files, torch.device("meta"):
        out = torch.zeros(17, dtype=torch.float32, device="cpu")
        files.read_into("w", Range(3, 20), out)
        whole = files.read_whole("w")
    assert torch.equal(out, values.reshape(-1)[3:20]) and whole.device.type == "cpu"
    assert torch.equal(whole.float(), values)
