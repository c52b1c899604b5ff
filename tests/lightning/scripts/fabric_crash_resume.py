"""A Fabric loop that saves every 2 steps and resumes by itself from zero_core.latest_checkpoint; for
tests/lightning/test_lightning_restarts.py, under ``torchrun --nproc-per-node 2 --max-restarts 1``.

Usage: python fabric_crash_resume.py OUT_DIR KILL_AFTER_STEP (-1: never). On the first attempt rank 1 SIGKILLs
itself after step KILL_AFTER_STEP. Rank 0 writes the final weights and the resumed step to OUT_DIR/result.pt.
"""

import os
import signal
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for lightning_zero/zero_core
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))  # tests/support: model, batches

import zero_core  # noqa: E402
from lightning_zero import ZeroFabricStrategy  # noqa: E402
from restarts import batch, make_model  # noqa: E402

STEPS, SAVE_EVERY = 8, 2


def main(out: Path, kill_after: int) -> None:
    torch.set_num_threads(1)
    strategy = ZeroFabricStrategy(stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=64)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    latest = zero_core.latest_checkpoint(out / "checkpoints")
    if latest is not None:
        fabric.load(latest, state)
    resumed_at, attempt = state["step"], zero_core.restart_attempt()
    for step in range(state["step"], STEPS):
        fabric.backward(model(batch(step, fabric.global_rank)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if state["step"] % SAVE_EVERY == 0:
            fabric.save(out / "checkpoints" / f"step-{state['step']}", state)
        if attempt == 0 and fabric.global_rank == 1 and step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = fabric.strategy.get_module_state_dict(model)
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "attempt": attempt, "resumed_at": resumed_at}, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
