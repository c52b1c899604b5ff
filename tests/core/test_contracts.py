"""The core's protocols (zero_core/contracts.py) hold for their implementations, and the public surface
(engine_of, is_partitioned, full_state_dict, consolidated_state_dict, the atomic helpers) does what
docs/core-api.md says, against the engine's own state as the reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("counter", torch.arange(3.0))

    def forward(self, tokens):
        return self.head(torch.relu(self.mid(self.embed(tokens)))).logsumexp(-1).mean()


def _contracts(rank: int, world_size: int, tmp: str) -> dict:
    import zero_core
    from zero_core import contracts, registry

    results = {}
    with zero_core.Init(config={"stage": 3, "param_persistence_threshold": 0}):
        built = nn.Linear(4, 4)
    pending = registry.pending_partition_of(built.weight)
    results["init"] = (isinstance(pending, contracts.PendingPartition), zero_core.is_partitioned(built.weight),
                       zero_core.engine_of(built.weight) is None)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = _Tied() if stage != 3 else built
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        engine = zero_core.setup(model, optimizer, {"stage": stage, "param_persistence_threshold": 0})
        x = torch.randint(0, 11, (4, 5)) if stage != 3 else torch.randn(3, 4)
        engine.backward(model(x) if stage != 3 else model(x).square().mean())
        engine.step()
        checks = {
            "runtime": isinstance(engine.runtime, contracts.Runtime),
            "parts": all(isinstance(p, contracts.Part) for p in engine.runtime.parts) and bool(engine.runtime.parts),
            "owner": isinstance(engine, contracts.ParamOwner),
            "checkpointed": isinstance(engine, contracts.CheckpointedEngine),
            "engine_of": zero_core.engine_of(model) is engine and all(
                zero_core.engine_of(p) is engine for p in model.parameters()),
            "is_partitioned": all(zero_core.is_partitioned(p) == (stage == 3) for p in model.parameters()),
            "pending_gone": registry.pending_partition_of(model.weight if stage == 3 else model.mid.weight) is None,
        }
        if stage == 3:  # the gradient side and the unit setup are written against the runtime: it has all they read
            from zero_core.stage3.gradients import GradientReductionHost
            from zero_core.stage3.unit_setup import UnitSetupHost

            checks["stage3_gradient_host"] = isinstance(engine.runtime, GradientReductionHost)
            checks["stage3_unit_setup_host"] = isinstance(engine.runtime, UnitSetupHost)
        engine.empty_partition_cache()  # a no-op at stages 1-2: part of the Runtime contract
        try:
            engine.optimizer_indices(_Wrapper(optimizer))
            checks["wrapper_refused"] = False
        except ValueError:
            checks["wrapper_refused"] = True  # the core unwraps no one's wrappers: front-ends pass indices
        checks["facade"] = engine.optimizer_indices(engine.optimizers[0]) == [0]
        engine.restore_skipped_steps(3)
        checks["skipped"] = engine.skipped_steps == 3
        engine.restore_skipped_steps(0)
        full = engine.full_state_dict(rank0_only=False)
        path = f"{tmp}/stage{stage}"
        engine.save_checkpoint(path)
        checks["is_checkpoint"] = zero_core.is_checkpoint(path) and not zero_core.is_checkpoint(tmp)
        consolidated = zero_core.consolidated_state_dict(path)
        checks["consolidated_keys"] = list(consolidated) == list(full) or sorted(consolidated) == sorted(full)
        checks["consolidated_values"] = all(torch.equal(consolidated[k], full[k]) for k in full)
        if stage == 1:
            untied = zero_core.consolidated_state_dict(path, dtype="bf16", tied_weights=False)
            checks["untied"] = "head.weight" not in untied and untied["mid.weight"].dtype == torch.bfloat16
            live = engine.full_state_dict(rank0_only=False, masters=False)
            checks["live"] = all(torch.equal(live[k], v.detach().cpu()) for k, v in model.state_dict().items())
        results[stage] = checks
        checks["in_memory"] = all(engine.offload_in_file(f) is None for f in engine.fragments())
        engine.close()
    # NVMe with 8-element tiles: the 6 x 6 Linear's piece stays in the swap file, read and written in slices
    torch.manual_seed(0)
    model = _Tied()
    config = {"stage": 3, "sub_group_size": 8, "offload_optimizer": {"device": "nvme", "nvme_path": tmp}}
    with zero_core.setup(model, torch.optim.AdamW(model.parameters(), lr=0.1), config) as engine:
        in_file = {f.name: engine.offload_in_file(f) for f in engine.fragments()}
        results["in_file"] = (isinstance(in_file["mid.weight"], contracts.PieceSlices)
                              and in_file["mid.bias"] is None)  # 6 elements: a tile brings it in
        engine.remove_offload_files()
    return results


class _Wrapper:
    """A foreign optimizer wrapper (like Lightning's or Fabric's): the core must not look inside it."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._optimizer = optimizer


def test_protocols_and_public_surface(tmp_path):
    result = run_distributed(_contracts, 1, str(tmp_path), timeout=120)[0]
    assert result["init"] == (True, True, True) and result["in_file"]
    for stage in (1, 2, 3):
        failed = [name for name, ok in result[stage].items() if not ok]
        assert not failed, f"stage {stage}: {failed}"


def test_atomic_directory_publishes_whole_or_nothing(tmp_path):
    import zero_core

    out = tmp_path / "out"
    with zero_core.atomic_directory(out, marker="done") as temp:
        (temp / "a").write_text("1")
        (temp / "done").write_text("")
        assert not out.exists()  # nothing visible before the block ends
    assert sorted(p.name for p in out.iterdir()) == ["a", "done"]
    with pytest.raises(RuntimeError):
        with zero_core.atomic_directory(out, marker="done") as temp:
            (temp / "b").write_text("2")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in out.iterdir()) == ["a", "done"]  # the earlier output is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind
    with zero_core.atomic_directory(out, marker="done") as temp:
        (temp / "done").write_text("")
    assert [p.name for p in out.iterdir()] == ["done"]  # replaced as a whole
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("")
    with pytest.raises(zero_core.CheckpointError, match="refusing to replace"):
        with zero_core.atomic_directory(tmp_path / "foreign", marker="done"):
            pass
    target = tmp_path / "file.bin"
    with zero_core.atomic_file(target) as partial:
        torch.save({"x": 1}, partial)
        assert not target.exists()
    assert torch.load(target) == {"x": 1}
