"""Readers that hand out ranges of full parameters and optimizer state, whatever wrote them.

A loading rank asks for elements ``[start, end)`` of the flattened parameter ``name``: exactly what one of its
fragments needs, whatever world size and stage saved the data. Sources:
- :class:`ShardedSource`: a sharded checkpoint; reads only the overlapping part of each stored fragment with
  ``safe_open(...).get_slice``, so a rank never reads what it does not keep.
- :class:`FullStateSource`: a plain model state dict (in memory, a ``.safetensors``/``.pt`` file, or a
  directory of Hugging Face-style shards with an index).
- :class:`PlainOptimizerSource`: a plain ``optimizer.state_dict()``, keyed through the parameter names.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open

from zero_core.layout import Range
from zero_core.checkpoint.shard_identity import SHARD_KEY

from zero_core.optim.weights_ema import EMA_KIND
from zero_core.checkpoint.format import MASTER_KIND, REPLICATED, CheckpointError, CheckpointMismatchError
from zero_core.checkpoint.values import decode_value

HF_INDEX = "model.safetensors.index.json"


def flat_range_of_rows(piece_reader, shape: list, rng: Range) -> torch.Tensor:
    """Elements ``rng`` of a flattened N-d tensor, reading only the rows (along dim 0) that hold them."""
    if len(shape) == 0:
        return piece_reader(...).reshape(-1)[rng.as_slice()]
    row = math.prod(shape[1:]) or 1
    first, last = rng.start // row, -(-rng.end // row)
    block = piece_reader(slice(first, last)).reshape(-1)
    return block[rng.start - first * row: rng.end - first * row]


class _SafetensorsFiles:
    """Open safetensors files (memory-mapped by safetensors), closed together."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def slice(self, file: str, key: str):
        if file not in self._handles:
            path = self.directory / file
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as error:
                raise CheckpointError(f"cannot read '{path}' as safetensors: {error}") from None
        try:
            return self._handles[file].get_slice(key)
        except Exception:
            raise CheckpointError(f"tensor '{key}' is missing from '{self.directory / file}'") from None

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


class ShardedSource:
    """Model and optimizer state from a sharded checkpoint directory."""

    def __init__(self, directory: Path, manifest: dict):
        self.manifest = manifest
        self.params = {p["name"]: p for p in manifest["parameters"]}
        self.replicated = {r["name"]: r for r in manifest["replicated"]}
        self.files = _SafetensorsFiles(Path(directory))

    def __enter__(self) -> "ShardedSource":
        return self

    def __exit__(self, *exc) -> None:
        self.files.close()

    # -- model ---------------------------------------------------------------------------------------------
    def shapes(self) -> dict[str, list[int]]:
        return {n: list(e["shape"]) for n, e in {**self.params, **self.replicated}.items()}

    def read(self, name: str, rng: Range, kind: str = MASTER_KIND) -> torch.Tensor:
        """Elements ``rng`` of ``name`` (fp32 master, or optimizer state ``kind``), 1-d."""
        if name in self.replicated:
            return self.read_whole(name).reshape(-1)[rng.as_slice()]
        out, covered = None, 0
        for fragment in self.params[name]["fragments"]:
            stored = Range(*fragment["param_range"])
            overlap = stored.intersect(rng)
            if overlap is None:
                continue
            piece = self._stored(name, fragment, kind)[overlap.start - stored.start: overlap.end - stored.start]
            if out is None:
                out = torch.empty(rng.size, dtype=piece.dtype)
            out[overlap.shift(-rng.start).as_slice()] = piece
            covered += overlap.size
        if covered != rng.size:
            raise CheckpointError(f"the checkpoint's fragments of '{name}' do not cover its elements "
                                  f"[{rng.start}, {rng.end}): the manifest is damaged")
        return out

    def _stored(self, name: str, fragment: dict, kind: str):
        entry = fragment["tensors"].get(kind)
        if entry is None:
            raise CheckpointError(f"the checkpoint has no {kind!r} for parameter '{name}' in '{fragment['file']}'")
        piece = self.files.slice(fragment["file"], entry["key"])
        numel = fragment["param_range"][1] - fragment["param_range"][0]
        if list(piece.get_shape()) != [numel]:
            raise CheckpointError(f"size mismatch: tensor '{entry['key']}' in '{fragment['file']}' has shape "
                                  f"{piece.get_shape()}, the manifest says [{numel}]")
        return piece

    def read_whole(self, name: str, kind: str = MASTER_KIND) -> torch.Tensor:
        """The whole tensor ``name``: a parameter's fp32 master (or its moving average, ``kind=EMA_KIND``), or a
        replicated buffer (which has no average: its value either way)."""
        if name in self.replicated:
            entry = self.replicated[name]
            piece = self.files.slice(REPLICATED, entry["key"])
            if list(piece.get_shape()) != list(entry["shape"]):
                raise CheckpointError(f"size mismatch: tensor '{entry['key']}' in '{REPLICATED}' has shape "
                                      f"{piece.get_shape()}, the manifest says {entry['shape']}")
            return piece[...]
        shape = self.params[name]["shape"]
        return self.read(name, Range(0, math.prod(shape)), kind).view(shape)

    # -- optimizer -----------------------------------------------------------------------------------------
    def state_keys(self) -> list[str]:
        return list(self.manifest["optimizer"]["per_element_keys"])

    def has_state(self, name: str) -> bool:
        fragments = self.params.get(name, {}).get("fragments", [])
        return any(set(f["tensors"]) - {MASTER_KIND, EMA_KIND} or f["scalars"] for f in fragments)

    def has_weights_ema(self) -> bool:
        """Whether the checkpoint holds the moving average of the weights (weights_ema_decay)."""
        return self.manifest.get("weights_ema") is not None

    def read_state(self, name: str, rng: Range, key: str) -> Optional[torch.Tensor]:
        fragments = self.params.get(name, {}).get("fragments", [])
        if not all(key in f["tensors"] for f in fragments):
            return None
        return self.read(name, rng, key)

    def scalars(self, name: str, device: torch.device) -> dict:
        fragments = self.params.get(name, {}).get("fragments", [])
        scalars = fragments[0]["scalars"] if fragments else {}
        return {key: decode_value(value, device) for key, value in scalars.items()}

    def hyperparameters(self) -> list[dict]:
        groups = self.manifest["optimizer"]["param_groups"]
        return [{k: decode_value(v) for k, v in g["hyperparameters"].items()} for g in groups]


class FullStateSource:
    """A plain (DDP or single-process) model state dict: a dict, a file, or a directory of shards."""

    def __init__(self, source: Any):
        self.files: Optional[_SafetensorsFiles] = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.located: dict[str, tuple[str, list[int]]] = {}  # safetensors: name -> (file, shape)
        if isinstance(source, dict):
            self.tensors = dict(source)
        else:
            self._open(Path(source))
        self._strip_ddp_prefix()

    def _open(self, path: Path) -> None:
        if path.is_dir():
            index = path / HF_INDEX
            if not index.is_file():
                raise FileNotFoundError(f"'{path}' has no {HF_INDEX}: give the directory of a consolidated model, "
                                        "a .safetensors or .pt file, or a sharded checkpoint directory")
            self._index(path, sorted(set(json.loads(index.read_text())["weight_map"].values())))
        elif not path.is_file():
            raise FileNotFoundError(f"no state dict file at '{path}'")
        elif path.suffix == ".safetensors":
            self._index(path.parent, [path.name])
        else:  # a torch file: weights_only never runs code from the file; mmap reads only what is used
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(self.tensors, dict):
                raise CheckpointError(f"'{path}' does not hold a state dict (a dict of tensors)")

    def _index(self, directory: Path, files: list[str]) -> None:
        self.files = _SafetensorsFiles(directory)
        for file in files:
            with safe_open(str(directory / file), framework="pt") as handle:
                for key in handle.keys():
                    self.located[key] = (file, list(handle.get_slice(key).get_shape()))

    def _strip_ddp_prefix(self) -> None:
        names = list(self.tensors) or list(self.located)
        if names and all(n.startswith("module.") for n in names):
            self.tensors = {n.removeprefix("module."): t for n, t in self.tensors.items()}
            self.located = {n.removeprefix("module."): v for n, v in self.located.items()}

    def __enter__(self) -> "FullStateSource":
        return self

    def __exit__(self, *exc) -> None:
        if self.files is not None:
            self.files.close()

    def shapes(self) -> dict[str, list[int]]:
        if self.located:
            return {n: shape for n, (_, shape) in self.located.items()}
        return {n: list(t.shape) for n, t in self.tensors.items() if torch.is_tensor(t)}

    def read(self, name: str, rng: Range, kind: str = MASTER_KIND) -> torch.Tensor:
        if name in self.tensors:
            return self.tensors[name].reshape(-1)[rng.as_slice()]
        file, shape = self.located[name]
        piece = self.files.slice(file, name)
        return flat_range_of_rows(lambda rows: piece[rows], shape, rng)

    def read_whole(self, name: str) -> torch.Tensor:
        shape = self.shapes()[name] if name not in self.tensors else list(self.tensors[name].shape)
        return self.read(name, Range(0, math.prod(shape))).view(shape)


class PlainOptimizerSource:
    """A torch ``optimizer.state_dict()`` (or a list of them, one per optimizer); integer ids map to names
    through the groups' parameter lists, groups counted across the optimizers in order."""

    def __init__(self, state_dict: Union[dict, list], group_param_names: list[list[str]]):
        state_dicts = state_dict if isinstance(state_dict, list) else [state_dict]
        for candidate in state_dicts:
            if not isinstance(candidate, dict) or not isinstance(candidate.get("param_groups"), list) \
                    or "state" not in candidate:
                raise CheckpointError("the optimizer state is not an optimizer.state_dict() (no state/param_groups)")
            shard = candidate.get(SHARD_KEY)
            if isinstance(shard, dict):
                raise CheckpointError(
                    f"the optimizer state is one rank's shard (rank {shard.get('rank')} of {shard.get('world_size')}, "
                    "from a ZeRO engine's optimizer.state_dict()), not a whole optimizer state: load a checkpoint "
                    "written by engine.save_checkpoint (or accelerator.save_state) instead")
        groups = [(sd, group) for sd in state_dicts for group in sd["param_groups"]]
        if len(groups) != len(group_param_names):
            raise CheckpointMismatchError(f"the optimizer state has {len(groups)} parameter groups, the engine's "
                                          f"optimizers {len(group_param_names)}")
        self.by_name: dict[str, dict] = {}
        for index, ((owner, group), names) in enumerate(zip(groups, group_param_names)):
            if len(group["params"]) != len(names):
                raise CheckpointMismatchError(
                    f"optimizer param_groups[{index}] holds {len(group['params'])} parameters in the state dict "
                    f"and {len(names)} in the engine's optimizer ({names[:3]}...)")
            for param_id, name in zip(group["params"], names):
                self.by_name[name] = owner["state"].get(param_id, {})
        self.groups = [{k: v for k, v in g.items() if k != "params"} for _, g in groups]

    def state_keys(self) -> list[str]:
        return sorted({k for s in self.by_name.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})

    def has_state(self, name: str) -> bool:
        return bool(self.by_name.get(name))

    def read_state(self, name: str, rng: Range, key: str) -> Optional[torch.Tensor]:
        value = self.by_name.get(name, {}).get(key)
        return value.reshape(-1)[rng.as_slice()] if torch.is_tensor(value) else None

    def scalars(self, name: str, device: torch.device) -> dict:
        state = self.by_name.get(name, {})
        return {k: v.to(device) if torch.is_tensor(v) else v
                for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}

    def hyperparameters(self) -> list[dict]:
        return self.groups
