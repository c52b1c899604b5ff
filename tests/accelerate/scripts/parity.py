"""examples/accelerate_train.py under plain Accelerate DDP and under ZeroAccelerator at stages 1, 2 and 3.

    accelerate-zero launch --config zero.yaml parity.py OUT.json

One process group, several runs in sequence (fp32, gradient accumulation, clipping, a scheduler); rank 0
writes each run's final weights (``get_state_dict``) and per-step gradient norms. Also records what the
"env" run (``ZeroAccelerator()`` with no arguments) read from zero.yaml, and a short bf16 and fp16 run with
the engine's own mixed precision, and the API checks of api_checks.py.
"""

import sys
from pathlib import Path

import torch
import torch._dynamo

from api_checks import run_api_checks
from common import STEPS, load_example, make_accelerator, rank, same_on_all_ranks, to_lists, write_json

MAX_NORM = 0.3  # below most steps' norms, so clipping acts

RUNS = {
    "ddp": "ddp",
    "zero1": {"stage": 1},
    "zero2": {"stage": 2, "reduce_bucket_size": 200},  # several buckets
    "zero3": {"stage": 3, "param_persistence_threshold": 0},  # partition every parameter
    "env": "env",
}
# dynamo_backend compiles the prepared model as plain Accelerate does (aot_eager: fast on CPU).
COMPILED_RUNS = {"ddp_compiled": "ddp", "zero1_compiled": {"stage": 1}, "zero2_compiled": {"stage": 2},
                 "zero3_compiled": RUNS["zero3"]}


def parity_run(example, kind, **accelerator_kwargs) -> dict:
    accelerator = make_accelerator(kind, **accelerator_kwargs)
    model, norms = example.train(accelerator, STEPS, max_grad_norm=MAX_NORM)
    state = accelerator.get_state_dict(model)
    out = {"norms": norms, "norms_agree_across_ranks": same_on_all_ranks(norms),
           "wrapped": type(model).__name__, "unwrapped_is_model": accelerator.unwrap_model(model) is model}
    if kind != "ddp":
        out["stage"] = accelerator.zero_plugin.stage
    if rank() == 0:
        out["weights"] = to_lists(state)
    return out


def precision_run(example, mixed_precision: str) -> dict:
    """A few steps with the engine's 16-bit training: dtypes, finite losses, the fp16 loss scale."""
    accelerator = make_accelerator({"stage": 2}, mixed_precision=mixed_precision)
    losses = []
    model, _ = example.train(accelerator, 4, on_step=lambda step, loss: losses.append(loss))
    engine = accelerator.zero_engine(model)
    masters = [m for part in engine.runtime.parts for m in part.masters]
    return {"param_dtype": str(next(model.parameters()).dtype), "master_dtype": str(masters[0].dtype),
            "losses": losses, "loss_scale": engine.loss_scale, "skipped": engine.skipped_steps}


def main() -> None:
    example = load_example()
    results = {name: parity_run(example, kind) for name, kind in RUNS.items()}
    for name, kind in COMPILED_RUNS.items():
        torch._dynamo.reset()
        results[name] = parity_run(example, kind, dynamo_backend="aot_eager")
    for mixed_precision in ("bf16", "fp16"):
        results[mixed_precision] = precision_run(example, mixed_precision)
    results["api"] = run_api_checks(Path(sys.argv[1]).parent)
    write_json(sys.argv[1], results)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
