"""Hand a run back to DeepSpeed: one of our checkpoints written as a DeepSpeed *universal* checkpoint, which
DeepSpeed resumes at any world size with ``"checkpoint": {"load_universal": true}`` (``load_universal_checkpoint``).

The layout is what DeepSpeed's ``ds_to_universal.py`` writes and ``universal_checkpoint.py`` reads (0.19.x)::

    OUT/latest_universal                           the tag, e.g. global_step8
    OUT/<tag>/mp_rank_00_model_states.pt           step counters, lr_scheduler, client state, buffers
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, where a stage 3 engine looks for it
    OUT/<tag>/zero/optimizer_state.pt              the optimizer's hyper-parameters per group
    OUT/<tag>/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt   {"param": whole tensor}, one file per tensor
    OUT/<tag>/zero/<param>/step.pt                 Adam's step (a tensor)

Every file is a plain torch pickle of dicts and tensors (no classes). One parameter is assembled at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from zero_core.layout import Range
from zero_core.checkpoint.files import atomic_directory
from zero_core.checkpoint.format import CLIENT_STATE, MASTER_KIND, CheckpointError, PathLike, read_manifest
from zero_core.checkpoint.node_local import require_whole
from zero_core.checkpoint.sources import ShardedSource
from zero_core.checkpoint.values import decode_value, load_client_state
from zero_core.checkpoint.verify import verify_files

LATEST_UNIVERSAL = "latest_universal"
ADAM_KEYS = ["exp_avg", "exp_avg_sq"]
# The format version DeepSpeed checks in optimizer_state.pt (stage 1 refuses versions before 0.3.17).
DEEPSPEED_FORMAT_VERSION = "0.19.8"


def write_deepspeed_universal(checkpoint_dir: PathLike, out_dir: PathLike, progress: bool = True,
                              verify: bool = True) -> Path:
    """Write checkpoint ``checkpoint_dir`` (ours) as a DeepSpeed universal checkpoint in ``out_dir``.

    The client_state's top-level keys go where DeepSpeed keeps a client_state; its ``lr_scheduler`` entry (if
    any) becomes DeepSpeed's scheduler state and ``global_steps`` (default: Adam's step) the step counter.
    ``out_dir`` appears only when complete. Needs no process group and no DeepSpeed.
    """
    path, out = Path(checkpoint_dir), Path(out_dir).absolute()
    manifest = read_manifest(path)
    require_whole(manifest, path)
    verify_files(path, manifest, sorted(manifest["files"]), checksum=verify)
    _check_handable(manifest, path)
    client = load_client_state(path) if CLIENT_STATE in manifest["files"] else None
    step = _step(manifest)
    global_steps = int(client.get("global_steps", step)) if isinstance(client, dict) else int(step)
    tag = f"global_step{global_steps}"
    with atomic_directory(out, marker=LATEST_UNIVERSAL) as temp:
        folder = temp / tag
        (folder / "zero").mkdir(parents=True)
        with ShardedSource(path, manifest) as source:
            _write_tensors(source, manifest, folder / "zero", progress)
            buffers = {r["name"]: source.read_whole(r["name"]) for r in manifest["replicated"]}
        torch.save(_optimizer_state(manifest, step), folder / "zero" / "optimizer_state.pt")
        states = _model_states(manifest, client, buffers, global_steps)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            torch.save(states, folder / name)
        (temp / LATEST_UNIVERSAL).write_text(tag)
    return out


def _check_handable(manifest: dict, path: Path) -> None:
    classes = manifest["optimizer"].get("classes", [manifest["optimizer"]["class"]])
    if len(classes) != 1:
        raise CheckpointError(f"'{path}' holds the state of {len(classes)} optimizers; a DeepSpeed engine has one")
    keys = sorted(manifest["optimizer"]["per_element_keys"])
    if keys != ADAM_KEYS:
        raise CheckpointError(f"'{path}' holds optimizer state {keys} ({classes[0]}); DeepSpeed's universal "
                              f"checkpoint carries Adam's {ADAM_KEYS} only")


def _step(manifest: dict) -> torch.Tensor:
    for entry in manifest["parameters"]:
        for fragment in entry["fragments"]:
            if "step" in fragment["scalars"]:
                return decode_value(fragment["scalars"]["step"])
    raise CheckpointError("the checkpoint's optimizer has no 'step': it has not stepped yet")


def _write_tensors(source: ShardedSource, manifest: dict, zero: Path, progress: bool) -> None:
    """Each parameter's fp32 master, moments and step, whole, one tensor in memory at a time."""
    for entry in tqdm(manifest["parameters"], desc="writing universal checkpoint", disable=not progress):
        name, shape = entry["name"], entry["shape"]
        folder = zero / name
        folder.mkdir()
        for kind in [MASTER_KIND, *ADAM_KEYS]:
            value = source.read(name, Range(0, math.prod(shape)), kind).view(shape)
            torch.save({"param": value}, folder / f"{kind}.pt")
        torch.save(source.scalars(name, torch.device("cpu"))["step"], folder / "step.pt")
    for entry in manifest["replicated"]:  # as ds_to_universal does for module entries without optimizer state
        (zero / entry["name"]).mkdir()
        torch.save({"param": source.read_whole(entry["name"]).float()}, zero / entry["name"] / "fp32.pt")


def _optimizer_state(manifest: dict, step: torch.Tensor) -> dict:
    """Hyper-parameters per group (stages 1/2 read ``param_groups``; stage 3 reads ``optimizer_state_dict``:
    its step and, for every group, group 0's hyper-parameters). No ``params`` key: stage 3 would empty its
    groups with it."""
    groups = [{k: decode_value(v) for k, v in g["hyperparameters"].items() if k != "params"}
              for g in manifest["optimizer"]["param_groups"]]
    return {"param_groups": groups, "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups},
            "ds_version": DEEPSPEED_FORMAT_VERSION}


def _model_states(manifest: dict, client: Any, buffers: dict, global_steps: int) -> dict:
    names = {p["name"]: p for p in manifest["parameters"]}
    groups = [{n: torch.Size(names[n]["shape"]) for n in g["param_names"] if n in names}
              for g in manifest["optimizer"]["param_groups"]]
    states = {"module": buffers, "buffer_names": list(buffers), "optimizer": None, "param_shapes": groups,
              "frozen_param_shapes": None, "shared_params": dict(manifest["aliases"]),
              "frozen_param_fragments": None, "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
              "skipped_steps": int(manifest.get("skipped_steps", 0)), "global_steps": global_steps,
              "dp_world_size": manifest["run"]["world_size"], "mp_world_size": 1,
              "ds_version": DEEPSPEED_FORMAT_VERSION}
    if isinstance(client, dict):
        states.update(client)  # DeepSpeed too puts client_state at the top level, over its own keys
        states["global_steps"] = global_steps
    return states
