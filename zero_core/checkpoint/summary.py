"""A readable summary of what a checkpoint holds (``zero-checkpoint inspect``); reads the manifest only,
plus the files themselves when asked to verify them."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zero_core.checkpoint.format import CLIENT_STATE, EXCLUDED, PathLike, read_manifest
from zero_core.checkpoint.values import decode_value
from zero_core.checkpoint.verify import verify_files


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return str(nbytes)


def describe(path: PathLike, verify: bool = False, tensors: bool = False) -> str:
    """Run, files, parameters, optimizer, loss scaler and client state of checkpoint ``path``, as text."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        verify_files(path, manifest, sorted(manifest["files"]))
    run, optimizer = manifest["run"], manifest["optimizer"]
    params = manifest["parameters"]
    lines = [
        f"checkpoint: {path}",
        f"format: {manifest['format']} v{manifest['format_version']}, created {run.get('created', '?')}",
        (f"run: converted from {run['converted_from']['format']} ('{run['converted_from']['path']}'), versions "
         if "converted_from" in run else f"run: ZeRO stage {run['stage']}, world size {run['world_size']}, versions ")
        + ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items()),
        f"files ({len(manifest['files'])}, {_size(sum(f['bytes'] for f in manifest['files'].values()))}):",
    ]
    lines += [f"  {name}  {_size(info['bytes'])}" for name, info in sorted(manifest["files"].items())]
    numel = sum(math.prod(p["shape"]) for p in params)
    lines.append(f"trainable parameters: {len(params)} tensors, {numel:,} elements (fp32 masters)")
    lines.append(f"replicated state: {len(manifest['replicated'])} tensors "
                 f"({', '.join(r['name'] for r in manifest['replicated'][:6])}"
                 f"{', ...' if len(manifest['replicated']) > 6 else ''})")
    excluded = manifest.get(EXCLUDED, [])
    if excluded:
        lines.append(f"frozen parameters left out (exclude_frozen_parameters): {len(excluded)} "
                     f"({', '.join(excluded[:6])}{', ...' if len(excluded) > 6 else ''}); a load keeps the model's own")
    if manifest["aliases"]:
        lines.append("tied weights: " + ", ".join(f"{a} -> {c}" for a, c in manifest["aliases"].items()))
    lines += _optimizer_lines(optimizer, params)
    lines.append(f"loss scaler: {manifest.get('loss_scaler')}, skipped steps: {manifest.get('skipped_steps', 0)}")
    lines.append(f"client state: {_client_keys(path) if CLIENT_STATE in manifest['files'] else 'none'}")
    if tensors:
        lines += _tensor_lines(params, manifest["replicated"])
    if verify:
        lines.append("verified: every file's size and SHA-256 match the manifest")
    return "\n".join(lines)


def _optimizer_lines(optimizer: dict, params: list) -> list[str]:
    saved = next((f["scalars"] for p in params for f in p["fragments"] if f["scalars"]), {})
    scalars = {k: decode_value(v).tolist() if isinstance(v, dict) else v for k, v in saved.items()}
    classes = optimizer.get("classes", [optimizer["class"]])
    if not classes:
        return ["optimizer: no state saved (weights only); a load starts the optimizer afresh"]
    lines = [f"optimizer{'s' if len(classes) > 1 else ''}: {', '.join(classes)}, per-element state "
             f"{optimizer['per_element_keys'] or 'none yet'}, scalars {scalars or 'none'}"]
    for index, group in enumerate(optimizer["param_groups"]):
        hyper = ", ".join(f"{k}={decode_value(v)}" for k, v in group["hyperparameters"].items())
        owner = f" (optimizer {group.get('optimizer', 0)})" if len(classes) > 1 else ""
        lines.append(f"  group {index}{owner}: {len(group['param_names'])} parameters; {hyper}")
    return lines


def _client_keys(path: Path) -> str:
    skeleton = torch.load(path / CLIENT_STATE, weights_only=True)
    return f"keys {sorted(map(str, skeleton))}" if isinstance(skeleton, dict) else type(skeleton).__name__


def _tensor_lines(params: list, replicated: list) -> list[str]:
    lines = ["tensors:"]
    for p in params:
        files = sorted({f["file"] for f in p["fragments"]})
        lines.append(f"  {p['name']}  {tuple(p['shape'])}  {p['dtype']}  group {p['group']}  "
                     f"{len(p['fragments'])} fragments in {', '.join(files)}")
    lines += [f"  {r['name']}  {tuple(r['shape'])}  {r['dtype']}  replicated" for r in replicated]
    return lines
