"""A DCP directory (FSDP2, torchtitan) as a source for the resharding load: each rank reads only the rows its
fragments need, at any world size, without a process group.

Implements :class:`zero_core.checkpoint.foreign.ForeignSource` (``ShardedSource``'s ``shapes``, ``read``,
``read_whole``, ``state_keys``, ``has_state``, ``read_state``, ``scalars``, ``hyperparameters``; DCP keeps no
loss scaler, skipped steps, client state or tied names, so those answers are trivial), so
``load.py``'s ``_load`` fills fp32 masters, Adam's ``exp_avg``/``exp_avg_sq``/``step`` and the groups'
hyper-parameters as from one of our checkpoints. Everything that could fail (missing data files, non-tensor
entries, optimizer state of a shape that cannot be sharded, unreadable hyper-parameters) fails while the source
is opened, before anything is loaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

from zero_core.layout import Range
from zero_core.checkpoint.format import MASTER_KIND, CheckpointError, CheckpointMismatchError
from zero_core.checkpoint.foreign.dcp_files import DCPFiles
from zero_core.checkpoint.foreign.dcp_layout import read_layout
from zero_core.checkpoint.sources import flat_range_of_rows


class DCPSource:
    """Model and optimizer state of a DCP directory. ``model_names`` (the engine's parameter and buffer names)
    settles an ambiguous ``model.`` prefix; ``group_param_names`` (the engine's groups) says which stored
    hyper-parameters go to which of the engine's groups."""

    def __init__(self, directory: Path, model_names: Optional[set] = None,
                 group_param_names: Optional[list[list[str]]] = None):
        self.files = DCPFiles(Path(directory))
        self.layout = read_layout({k: self.files.is_tensor(k) for k in self.files.entries}, model_names)
        for key in [*self.layout.model.values(), *(k for e in self.layout.state.values() for k in e.values())]:
            self.files.check_chunks(key)
        self._per_element, self._scalar_keys = self._split_state()
        self._groups = self._read_groups()
        self._engine_groups = group_param_names

    def __enter__(self) -> "DCPSource":
        return self

    def __exit__(self, *exc) -> None:
        pass  # FileSystemReader opens each file per read

    # -- model ---------------------------------------------------------------------------------------------
    def shapes(self) -> dict[str, list[int]]:
        return {name: self.files.shape(key) for name, key in self.layout.model.items()}

    def read(self, name: str, rng: Range, kind: str = MASTER_KIND) -> torch.Tensor:
        key = self.layout.model[name] if kind == MASTER_KIND else self.layout.state[name][kind]
        return self._read_range(key, rng)

    def _read_range(self, key: str, rng: Range) -> torch.Tensor:
        def rows(selection):
            if selection is Ellipsis:
                return self.files.read_rows(key, 0, 0)
            return self.files.read_rows(key, selection.start, selection.stop)

        return flat_range_of_rows(rows, self.files.shape(key), rng)

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(self.layout.model[name])

    def read_whole(self, name: str) -> torch.Tensor:
        shape = self.files.shape(self.layout.model[name])
        return self.read(name, Range(0, math.prod(shape))).view(shape)

    # -- optimizer -----------------------------------------------------------------------------------------
    def has_optimizer(self) -> bool:
        return bool(self.layout.state or self._groups)

    def _split_state(self) -> tuple[list[str], dict[str, list[str]]]:
        """Per-element state keys (the parameter's shape) apart from each parameter's scalar ones (``step``)."""
        per_element, scalars = set(), {}
        for name, entries in self.layout.state.items():
            shape = self.files.shape(self.layout.model[name])
            for state_key, key in entries.items():
                if self.files.is_tensor(key) and self.files.shape(key) == shape and shape:
                    per_element.add(state_key)
                elif self.files.is_tensor(key) and self.files.shape(key):
                    raise CheckpointError(
                        f"the DCP optimizer state '{key}' has shape {tuple(self.files.shape(key))}, neither the "
                        f"shape {tuple(shape)} of parameter '{name}' nor a scalar: this optimizer's state cannot be "
                        "sharded")
                else:
                    scalars.setdefault(name, []).append(state_key)
        return sorted(per_element), scalars

    def state_keys(self) -> list[str]:
        return list(self._per_element)

    def has_state(self, name: str) -> bool:
        return bool(self.layout.state.get(name))

    def read_state(self, name: str, rng: Range, key: str) -> Optional[torch.Tensor]:
        if key not in self.layout.state.get(name, {}) or key not in self._per_element:
            return None
        return self.read(name, rng, key)

    def scalars(self, name: str, device: torch.device) -> dict:
        out = {}
        for state_key in self._scalar_keys.get(name, []):
            key = self.layout.state[name][state_key]
            if self.files.is_tensor(key):
                out[state_key] = self.files.read_rows(key, 0, 0).to(device)
            else:
                out[state_key] = self._bytes[key]
        return out

    def _read_groups(self) -> list[tuple[list[str], dict]]:
        """The stored groups as (parameter names, hyper-parameters); flattened layouts: one per parameter."""
        layout = self.layout
        scalar_bytes = [k for entries in layout.state.values() for k in entries.values()
                        if not self.files.is_tensor(k)]
        hp_keys = [k for entries in layout.groups for k in entries.values()]
        hp_keys += [k for entries in layout.per_param_hyperparameters.values() for k in entries.values()]
        wanted = layout.params_keys + hp_keys + scalar_bytes
        self._bytes = self.files.read_all_bytes([k for k in wanted if not self.files.is_tensor(k)])
        self._bytes.update({k: self.files.read_rows(k, 0, 0) for k in hp_keys if self.files.is_tensor(k)
                            and not self.files.shape(k)})  # a 0-d tensor lr (capturable optimizers)
        groups = []
        for params_key, entries in zip(layout.params_keys, layout.groups):
            names = self._bytes[params_key]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise CheckpointError(f"the DCP entry '{params_key}' does not list parameter names (it holds "
                                      f"{type(names).__name__}): this optimizer layout is not supported")
            groups.append((names, {hp: self._bytes[k] for hp, k in entries.items()}))
        for name, entries in layout.per_param_hyperparameters.items():
            groups.append(([name], {hp: self._bytes[k] for hp, k in entries.items()}))
        return groups

    def hyperparameters(self) -> list[dict]:
        """One dict per group of the engine (per stored group when there is no engine): the stored values of
        the group's first parameter found in the checkpoint."""
        if self._engine_groups is None:
            return self.stored_groups()[1]
        of = {name: values for names, values in self._groups for name in names}
        out = []
        for names in self._engine_groups:
            found = next((n for n in names if n in of), None)
            if found is None:
                raise CheckpointMismatchError(f"the DCP checkpoint has no optimizer hyper-parameters for the "
                                              f"engine's group of {names[:3]}...")
            out.append(dict(of[found]))
        return out

    def stored_groups(self) -> tuple[list[list[str]], list[dict]]:
        """The checkpoint's own groups (parameter names, hyper-parameters): as stored; a flattened layout
        stores values per parameter, so parameters with equal values make one group, in order."""
        if self.layout.groups:
            return [list(n) for n, _ in self._groups], [dict(v) for _, v in self._groups]
        merged: list[tuple[list[str], dict]] = []
        for (name,), values in self._groups:
            same = next((group for group in merged if group[1] == values), None)
            if same is None:
                merged.append(([name], dict(values)))
            else:
                same[0].append(name)
        return [n for n, _ in merged], [v for _, v in merged]

    # -- the rest of the run: not in a DCP checkpoint ---------------------------------------------------------
    def loss_scaler(self) -> None:
        return None

    def skipped_steps(self) -> int:
        return 0

    def client_state(self) -> None:
        return None  # torchtitan's train_state, lr_scheduler and dataloader entries are left alone

    def aliases(self) -> dict[str, str]:
        return {}

    def origin(self) -> dict:
        return {}
