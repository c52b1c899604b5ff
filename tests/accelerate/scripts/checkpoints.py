"""save_state/load_state, DDP checkpoints into ZeRO and back, and save_model, in one launch.

    accelerate launch --config_file accelerate.yaml checkpoints.py OUT.json WORKDIR

Launched by plain ``accelerate launch`` with a pure Accelerate config: the ZeRO settings of the "env" runs come
from the file named by ACCELERATE_ZERO_CONFIG_FILE, the others from code. Runs, each a fresh Accelerator:

1. zero3 (env file): N steps, save_state after step K  -> W_z3 and the sharded checkpoint
2. zero3 (env file): resume from that checkpoint        -> must equal W_z3 exactly
3. ddp: N steps, save_state after step K                -> W_ddp and a plain Accelerate checkpoint
4. zero2 (code): resume from the DDP checkpoint         -> must match W_ddp
5. ddp: resume from the ZeRO checkpoint, exported       -> must match W_ddp
6. save_model of run 1's model (one file, and sharded with an index) loaded into fresh models
"""

import json
import sys
from pathlib import Path

import torch
from accelerate.utils import load_checkpoint_in_model
from safetensors.torch import load_file

from accelerate_zero import export_accelerate_state
from common import load_example, make_accelerator, rank, to_lists, write_json

STEPS, SAVE_AT = 12, 5


def weights(accelerator, model) -> dict:
    state = accelerator.get_state_dict(model)
    return to_lists(state) if rank() == 0 else {}


def outputs_match(example, reference: torch.Tensor, inputs: torch.Tensor, directory: Path) -> dict:
    """Rank 0: fresh models loaded from save_model's files give exactly the trained model's outputs."""
    files = sorted(p.name for p in directory.iterdir())
    fresh = example.make_model()
    if (directory / "model.safetensors").is_file():
        fresh.load_state_dict(load_file(str(directory / "model.safetensors")))
    else:
        load_checkpoint_in_model(fresh, str(directory), strict=True)
    with torch.no_grad():
        diff = (fresh(inputs) - reference).abs().max().item()
    return {"files": files, "max_abs_diff": diff}


def save_model_checks(example, accelerator, model, work: Path) -> dict:
    inputs = torch.randn(5, example.FEATURES, generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        reference = model(inputs)  # every rank: stage 3 gathers during forward
    results = {}
    for name, size in (("single", "10GB"), ("sharded", "600B")):
        accelerator.save_model(model, work / f"saved-{name}", max_shard_size=size)
        accelerator.wait_for_everyone()
        if rank() == 0:
            results[name] = outputs_match(example, reference, inputs, work / f"saved-{name}")
    return results


def latest_state_check(work: Path) -> dict:
    """load_state() with no directory (automatic_checkpoint_naming) skips a damaged newest state and loads the
    newest complete one (zero_core.latest_checkpoint's rule, per ZeRO model)."""
    import os

    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(work / "auto"), automatic_checkpoint_naming=True)
    accelerator = make_accelerator({"stage": 2}, project_config=project, gradient_accumulation_steps=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state()  # checkpoint_0: the initial weights
    first = weights(accelerator, model)  # rank 0: the weights as lists; other ranks: {}
    accelerator.backward(model(torch.ones(2, 5)).pow(2).sum())
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state()  # checkpoint_1: after one step
    newest = work / "auto" / "checkpoints" / "checkpoint_1" / "zero_model"
    shard = newest / "shard-00001-of-00002.safetensors"
    os.truncate(shard, json.loads((newest / "manifest.json").read_text())["files"][shard.name]["bytes"] // 2)
    accelerator.wait_for_everyone()
    accelerator.load_state()
    return {"back_to_first": weights(accelerator, model) == first}


def main() -> None:
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    example, results = load_example(), {}

    accelerator = make_accelerator("env")
    model, _ = example.train(accelerator, STEPS, save_state=work / "zero-ckpt", save_at=SAVE_AT)
    results["z3"] = weights(accelerator, model)
    results["z3_stage"] = accelerator.zero_plugin.stage
    results["save_model"] = save_model_checks(example, accelerator, model, work)

    accelerator = make_accelerator("env")
    model, _ = example.train(accelerator, STEPS, resume_from=work / "zero-ckpt")
    results["z3_resumed"] = weights(accelerator, model)

    accelerator = make_accelerator("ddp")
    model, _ = example.train(accelerator, STEPS, save_state=work / "ddp-ckpt", save_at=SAVE_AT)
    results["ddp"] = weights(accelerator, model)

    accelerator = make_accelerator({"stage": 2})
    model, _ = example.train(accelerator, STEPS, resume_from=work / "ddp-ckpt")
    results["z2_from_ddp"] = weights(accelerator, model)

    if rank() == 0:
        export_accelerate_state(work / "zero-ckpt", work / "exported")
    accelerator.wait_for_everyone()
    accelerator = make_accelerator("ddp")
    model, _ = example.train(accelerator, STEPS, resume_from=work / "exported")
    results["ddp_from_zero"] = weights(accelerator, model)

    results["latest_state"] = latest_state_check(work)

    if rank() == 0:
        results["zero_ckpt_files"] = sorted(str(p.relative_to(work / "zero-ckpt"))
                                            for p in (work / "zero-ckpt").rglob("*") if p.is_file())
        results["zero_state"] = json.loads((work / "zero-ckpt" / "zero_state.json").read_text())
    write_json(out, results)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
