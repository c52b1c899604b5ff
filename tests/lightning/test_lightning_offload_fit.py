"""The offload strategies through a real 2-process Trainer.fit (Lightning's launcher): zero2_offload,
zero3_offload and ZeroStrategy(offload_optimizer="nvme", offload_parameters="nvme", nvme_path=...) end with DDP's
weights (AdamW, a step scheduler, accumulation, clipping), with no warning about offload; the NVMe run's swap
files are gone from nvme_path when fit returns (the strategy's teardown), also when training_step raises, and
none is left once the processes exit; its Trainer.save_checkpoint after fit (NVMe state streamed) resumes a
fresh module to the same weights;
zero3_offload_nvme on a missing /local_nvme fails before training, naming nvme_path;
ZeroStrategy with offload_optimizer.host_kernel: compiled (the compiled host kernel) ends with DDP's weights too;
zero3 with overlap_with_backward fits (accumulating) to DDP's weights without clipping
(lightning/scripts/fit_offload.py)."""

from __future__ import annotations

import pytest

from lightning_runs import load_json, load_rank, max_diff, run

WEIGHT_TOLERANCE = 1e-5  # float reordering only
DEVICES = {"zero2_offload": ["cpu", "none"], "zero3_offload": ["cpu", "cpu"], "zero3_infinity": ["nvme", "nvme"],
           "zero3_compiled": ["cpu", "none"]}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit_offload")
    nvme = tmp_path_factory.mktemp("nvme")
    run("fit_offload.py", str(path), str(nvme), timeout=430)
    (path / "nvme_files_at_exit").write_text("\n".join(sorted(p.name for p in nvme.iterdir())))
    return path


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", sorted(DEVICES))
def test_offload_strategy_fits_to_ddp_weights_without_warning(out, name):
    results = load_json(out, "offload")
    reference = load_rank(out, "offload_ddp")
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, f"offload_{name}", rank)) <= WEIGHT_TOLERANCE, (name, rank)
    got = results[name]
    assert got["devices"] == DEVICES[name]
    assert got["global_step"] == results["ddp"]["global_step"] > 0
    assert got["offload_warnings"] == [], got["offload_warnings"]
    if name == "zero3_compiled":  # offload_optimizer.host_kernel: compiled stepped (in chunks, after the first step)
        assert got["chunks_stepped"] > 0, got
    if name == "zero3_infinity":  # one optimizer and one parameter file per rank while training
        assert sorted(f.rsplit("_", 2)[0] for f in got["nvme_files_during"]) == sorted(
            f"zero_{kind}_rank{rank}" for kind in ("offload", "params") for rank in (0, 1)), got
        assert got["nvme_files_after_fit"] == [[], []], got  # removed by the teardown, in the same process
        assert got["resumed_diff"] == 0.0, got  # Trainer.save_checkpoint after fit, loaded by a fresh fit
    assert (out / "nvme_files_at_exit").read_text() == ""  # every swap file removed when the ranks exited


@pytest.mark.timeout(480)
def test_steps_started_during_backward_fit_to_ddp_weights_with_accumulation(out):
    """overlap_with_backward through Lightning's loop (accumulate_grad_batches=2: its no_sync micro-batches do
    not reduce, so each reducing backward is followed by the step): units' steps did start during backward, and
    the weights are DDP's (both without clipping, which the early start refuses)."""
    reference = load_rank(out, "offload_ddp_unclipped")
    got = load_json(out, "offload")["zero3_overlap_backward"]
    for rank in (0, 1):
        assert max_diff(reference, load_rank(out, "offload_zero3_overlap_backward", rank)) <= WEIGHT_TOLERANCE, rank
    assert got["started_in_backward"] > 0 and got["overlapped_steps"] > 0, got
    assert got["global_step"] == load_json(out, "offload")["ddp_unclipped"]["global_step"] > 0
    assert got["offload_warnings"] == [], got["offload_warnings"]


@pytest.mark.timeout(480)
def test_failed_fit_removes_swap_files(out):
    got = load_json(out, "offload")["zero3_infinity_fails"]
    assert got["error"] == "RuntimeError: training_step fails on purpose", got
    assert len(got["nvme_files_during"]) == 4 and got["nvme_files_after_fit"] == [[], []], got


@pytest.mark.timeout(480)
def test_missing_nvme_path_fails_before_training(out):
    error = load_json(out, "offload")["zero3_offload_nvme"]["error"]
    assert error.startswith("ValueError") and "nvme_path='/local_nvme' is not an existing directory" in error, error
