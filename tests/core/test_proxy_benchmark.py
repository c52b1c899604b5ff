"""The CPU proxy benchmark (benchmarks/proxy.py) runs in both of its modes, and every implementation in it trains
the same model to the same loss as plain training, so the times it compares are of the same work."""

from __future__ import annotations

import json
import sys

import pytest

from launch import REPO, run


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [[], ["--per-step"]], ids=["best-of-repeats", "per-step"])
def test_the_proxy_compares_the_same_training(tmp_path, mode):
    out = tmp_path / "proxy.json"
    command = [sys.executable, "-m", "benchmarks.proxy", "--blocks", "3", "--steps", "2", "--warmup", "1",
               "--repeats", "1", "--fused", "--impls", "plain", "zero1", "zero2", "zero3", "--json", str(out), *mode]
    output = run(command, timeout=150, cwd=REPO, stderr_apart=True)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"plain", "zero1", "zero2", "zero3"}
    for impl, result in results.items():
        assert result["step_s"] > 0
        assert abs(result["loss"] - results["plain"]["loss"]) <= 1e-5 * abs(results["plain"]["loss"]), (impl, results)
    assert results["zero3"]["units"] == 3  # one per block (persistence 0: every block is partitioned)
    assert "| zero2 |" in output
