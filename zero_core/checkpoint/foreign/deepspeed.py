"""Take over a DeepSpeed ZeRO run: its checkpoint directory read as a source for the resharding loader.

A DeepSpeed checkpoint is a directory with ``latest`` (naming a tag folder) or the tag folder itself, holding
``mp_rank_00_model_states.pt`` (stage 3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank) and one
``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank (the ``bf16_`` prefix when the
run trained in bf16). The optimizer files hold the fp32 masters and Adam's moments as flat partitions
(deepspeed_layout.py says where each parameter sits). Every file goes through the restricted unpickler
(unpickle.py): DeepSpeed need not be installed, and nothing from the file runs.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import torch

from zero_core.layout import Range
from zero_core.checkpoint.format import MASTER_KIND, CheckpointError
from zero_core.checkpoint.foreign.deepspeed_layout import Piece, stage3_pieces, stage12_pieces
from zero_core.checkpoint.foreign.unpickle import StandIn, load_restricted

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"(?P<bf16>bf16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt")
_RANK_MODEL = re.compile(r"zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt")
_MP_MODEL = re.compile(r"mp_rank_(?P<mp>\d+)_model_states\.pt")
_MOE = re.compile(r"(expp_rank_\d+_.*|layer_\d+_expert_\d+_.*)\.pt")
_PIPELINE_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")

# What DeepSpeed's model-states file holds besides the client_state its caller passed (kept at the top level).
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "ds_config", "ds_version", "dp_world_size", "mp_world_size",
                   "checkpoint_parallel_dimensions", "sparse_tensor_module_names"}


class _LossScaler(StandIn):
    pass


class _FragmentAddress(StandIn):
    pass


def _zero_stage(value: Any) -> int:
    return int(value)


STAND_INS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _LossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": _FragmentAddress,
}


def tag_folder(path: Path) -> Optional[Path]:
    """The folder holding a DeepSpeed checkpoint's files, or None when ``path`` is not one."""
    if (path / LATEST).is_file():
        tag = (path / LATEST).read_text().strip()
        if not (path / tag).is_dir():
            raise CheckpointError(f"'{path / LATEST}' names the tag '{tag}', but '{path / tag}' is not a directory")
        return path / tag
    names = [f.name for f in path.iterdir()] if path.is_dir() else []
    if any(_OPTIM.fullmatch(n) or _RANK_MODEL.fullmatch(n) or _MP_MODEL.fullmatch(n) for n in names):
        return path
    return None


def is_deepspeed_directory(path: Path) -> bool:
    return path.is_dir() and tag_folder(path) is not None


def _check_supported(folder: Path) -> tuple[list[Path], int]:
    """The optimizer files in rank order and the ZeRO world size; refuses what this reader cannot take over."""
    names = sorted(f.name for f in folder.iterdir())
    for name in names:
        if _MOE.fullmatch(name):
            raise CheckpointError(f"'{folder / name}' is a Mixture-of-Experts expert file: DeepSpeed MoE "
                                  "checkpoints (expert parallelism) are not supported")
        if _PIPELINE_LAYER.fullmatch(name):
            raise CheckpointError(f"'{folder / name}' is a pipeline-parallel layer file: DeepSpeed pipeline "
                                  "checkpoints are not supported")
        match = _OPTIM.fullmatch(name) or _RANK_MODEL.fullmatch(name) or _MP_MODEL.fullmatch(name)
        if match and int(match["mp"]) != 0:
            raise CheckpointError(f"'{folder / name}' belongs to model-parallel rank {int(match['mp'])}: "
                                  "tensor- or pipeline-parallel DeepSpeed checkpoints are not supported (only "
                                  "data-parallel ZeRO, mp_rank_00)")
    optim = {int(m["rank"]): folder / n for n in names if (m := _OPTIM.fullmatch(n))}
    if not optim and (folder / "zero").is_dir():
        raise CheckpointError(f"'{folder}' is a DeepSpeed universal checkpoint (zero/<param>/...): not read here; "
                              "load the DeepSpeed checkpoint it was made from")
    if not optim:
        raise CheckpointError(f"'{folder}' has no ZeRO optimizer files (*zero_pp_rank_<r>_mp_rank_00_optim_states"
                              ".pt): DeepSpeed checkpoints saved without ZeRO (stage 0) are not supported")
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in optim.values()) else ""
    count = max(optim) + 1
    return [optim.get(r, folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(count)], count


class DeepSpeedSource:
    """fp32 masters, Adam state and hyper-parameters of a DeepSpeed ZeRO checkpoint (stages 1-3, any world
    size), in the protocol of :class:`zero_core.checkpoint.foreign.ForeignSource`. Each optimizer file is opened
    (memory-mapped) only when a requested range lies in it. ``model_names`` and ``group_param_names`` (the
    engine's, from ``open_source``) are not needed: DeepSpeed stores full parameter names, and its optimizer
    groups are the engine's, in order."""

    def __init__(self, path: Path, model_names: Optional[set] = None,
                 group_param_names: Optional[list[list[str]]] = None):
        folder = tag_folder(Path(path))
        if folder is None:
            raise CheckpointError(f"'{path}' is not a DeepSpeed checkpoint (no '{LATEST}' file and no "
                                  "*_model_states.pt / *_optim_states.pt files)")
        self.folder = folder
        self.optim_files, found = _check_supported(folder)
        self._optim: dict[int, dict] = {}
        first = self._optim_state(0)
        self.stage = int(first["zero_stage"])
        count = first["partition_count"]
        self.world = max(count) if isinstance(count, (list, tuple)) else int(count)
        self._check_rank_files(found)
        self.model_states = self._load(self._model_file(0))
        self._pieces = self._layout(first)
        self._frozen_cache: dict[str, torch.Tensor] = {}

    # -- files -----------------------------------------------------------------------------------------------
    def _load(self, path: Path) -> dict:
        if not path.is_file():
            raise CheckpointError(f"the DeepSpeed checkpoint '{self.folder}' lacks '{path.name}'")
        loaded = load_restricted(path, STAND_INS)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"'{path}' does not hold a DeepSpeed state dict")
        return loaded

    def _model_file(self, rank: int) -> Path:
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3 else MODEL_STATES
        return self.folder / name

    def _check_rank_files(self, found: int) -> None:
        prefix = "bf16_" if any(p.name.startswith("bf16_") for p in self.optim_files) else ""
        expected = [self.folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(self.world)]
        missing = [p.name for p in expected if not p.is_file()]
        if missing:
            raise CheckpointError(f"the DeepSpeed checkpoint '{self.folder}' was saved by {self.world} ranks but "
                                  f"lacks the optimizer file(s) {missing}")
        if found > self.world:
            raise CheckpointError(f"'{self.folder}' holds optimizer files of {found} ranks, but they say the run "
                                  f"had {self.world}: files of another save were left there")
        self.optim_files = expected

    def _optim_state(self, rank: int) -> dict:
        if rank not in self._optim:
            path = self.optim_files[rank]
            state = self._load(path).get("optimizer_state_dict")
            if not isinstance(state, dict) or "zero_stage" not in state:
                raise CheckpointError(f"'{path}' is not a DeepSpeed ZeRO optimizer file (no zero_stage)")
            flats = state.get("fp32_flat_groups" if int(state["zero_stage"]) == 3 else
                              "single_partition_of_fp32_groups")
            if flats is None:
                raise CheckpointError(f"'{path}' holds no fp32 partitions for ZeRO stage {int(state['zero_stage'])}")
            base = state.get("optimizer_state_dict" if int(state["zero_stage"]) == 3 else "base_optimizer_state")
            state["_flats"], state["_flat_states"] = list(flats), _flat_states(base, len(flats), path)
            state["_param_groups"] = base["param_groups"]
            sizes = [f.numel() for f in flats]
            # Stages 1/2 save the last rank's partitions without their end padding: shorter, never longer.
            if rank and (len(sizes) != len(self._flat_sizes) or any(
                    s > r if self.stage < 3 else s != r for s, r in zip(sizes, self._flat_sizes))):
                raise CheckpointError(f"'{path}' holds partitions of {sizes} elements, rank 0's file "
                                      f"{self._flat_sizes}: the files come from different runs")
            self._optim[rank] = state
        return self._optim[rank]

    def _layout(self, first: dict) -> dict[str, list[Piece]]:
        groups = self.model_states.get("param_shapes")
        if not isinstance(groups, list):
            raise CheckpointError(f"'{self._model_file(0)}' has no param_shapes: not a ZeRO checkpoint")
        self._flat_sizes = [f.numel() for f in first["_flats"]]
        self.param_shapes = {n: list(s) for g in groups for n, s in g.items()}
        if self.stage == 3:
            return stage3_pieces(self.param_shapes, self._flat_sizes, self.world)
        if len(groups) != len(self._flat_sizes):
            raise CheckpointError(f"'{self.optim_files[0]}' has {len(self._flat_sizes)} partitions, the model states "
                                  f"{len(groups)} parameter groups")
        return stage12_pieces(groups, self._flat_sizes, self.world, first.get("param_alignment_paddings"))

    def __enter__(self) -> "DeepSpeedSource":
        return self

    def __exit__(self, *exc) -> None:
        self._optim.clear()

    # -- model -----------------------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        names = set(self.model_states.get("buffer_names") or [])
        return {n: t for n, t in (self.model_states.get("module") or {}).items() if n in names}

    def _frozen_shapes(self) -> dict[str, list[int]]:
        return {n: list(s) for n, s in (self.model_states.get("frozen_param_shapes") or {}).items()}

    def shapes(self) -> dict[str, list[int]]:
        buffers = {n: list(t.shape) for n, t in self._buffers().items()}
        return {**self.param_shapes, **buffers, **self._frozen_shapes()}

    def read(self, name: str, rng: Range, kind: str = MASTER_KIND) -> torch.Tensor:
        """Elements ``rng`` of ``name`` (fp32 master or optimizer state ``kind``), 1-d, from the pieces that
        overlap it."""
        if name not in self._pieces:
            return self.read_whole(name).reshape(-1)[rng.as_slice()]
        out, covered = torch.empty(rng.size, dtype=torch.float32), 0
        for piece in self._pieces[name]:
            overlap = Range(piece.param_start, piece.param_start + piece.size).intersect(rng)
            if overlap is None:
                continue
            source = self._flat(piece, kind)
            start = piece.flat_start + overlap.start - piece.param_start
            out[overlap.shift(-rng.start).as_slice()] = source[start: start + overlap.size]
            covered += overlap.size
        if covered != rng.size:
            raise CheckpointError(f"DeepSpeed's partitions of '{name}' do not cover its elements [{rng.start}, "
                                  f"{rng.end})")
        return out

    def _flat(self, piece: Piece, kind: str) -> torch.Tensor:
        state = self._optim_state(piece.rank)
        if kind == MASTER_KIND:
            return state["_flats"][piece.flat]
        value = state["_flat_states"][piece.flat].get(kind)
        if not torch.is_tensor(value) or value.numel() < state["_flats"][piece.flat].numel():  # may keep padding
            raise CheckpointError(f"'{self.optim_files[piece.rank]}' has no per-element optimizer state {kind!r} "
                                  f"for partition {piece.flat}")
        return value

    def read_whole(self, name: str) -> torch.Tensor:
        if name in self._pieces:
            shape = self.param_shapes[name]
            return self.read(name, Range(0, math.prod(shape))).view(shape)
        buffers = self._buffers()
        if name in buffers:
            return buffers[name].clone()
        return self._frozen(name)

    def _frozen(self, name: str) -> torch.Tensor:
        """A parameter outside every optimizer group: whole in stages 1/2, a 1/world slice per rank's model
        states file in stage 3 (padded at the end)."""
        shape = self._frozen_shapes().get(name)
        if shape is None:
            raise CheckpointError(f"the DeepSpeed checkpoint '{self.folder}' has no tensor '{name}'")
        if name not in self._frozen_cache:
            if self.stage == 3:
                parts = [self._load(self._model_file(r))["frozen_param_fragments"][name].reshape(-1)
                         for r in range(self.world)]
                value = torch.cat(parts)[: math.prod(shape)]
            else:
                value = self.model_states["frozen_param_fragments"][name].reshape(-1)
            self._frozen_cache[name] = value.clone().view(shape)
        return self._frozen_cache[name]

    # -- optimizer -------------------------------------------------------------------------------------------
    def _state_of(self, name: str) -> dict:
        pieces = self._pieces.get(name)
        if not pieces:
            return {}
        return self._optim_state(pieces[0].rank)["_flat_states"][pieces[0].flat]

    def state_keys(self) -> list[str]:
        keys = {k for s in self._optim_state(0)["_flat_states"] for k, v in s.items()
                if torch.is_tensor(v) and v.dim() > 0}
        return sorted(keys)

    def has_state(self, name: str) -> bool:
        return bool(self._state_of(name))

    def read_state(self, name: str, rng: Range, key: str) -> Optional[torch.Tensor]:
        if key not in self._state_of(name):
            return None
        return self.read(name, rng, key)

    def scalars(self, name: str, device: torch.device) -> dict:
        state = self._state_of(name)
        return {k: v.clone().to(device) if torch.is_tensor(v) else v
                for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}

    def hyperparameters(self) -> list[dict]:
        groups = self._optim_state(0)["_param_groups"]
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def has_optimizer(self) -> bool:
        return bool(self.state_keys())

    def stored_groups(self) -> tuple[list[list[str]], list[dict]]:
        """The trainable parameters of each optimizer group, in order, and the groups' hyper-parameters."""
        names, values = [list(g) for g in self.model_states["param_shapes"]], self.hyperparameters()
        if len(names) != len(values):
            raise CheckpointError(f"the checkpoint lists {len(names)} parameter groups but the optimizer state "
                                  f"{len(values)}")
        return names, values

    # -- the rest of the run ---------------------------------------------------------------------------------
    def client_state(self) -> dict:
        """What DeepSpeed's ``load_checkpoint`` hands back (the caller's client_state), plus its own
        ``lr_scheduler``, ``global_steps``, ``global_samples`` and ``skipped_steps``."""
        return {k: _copied(v) for k, v in self.model_states.items() if k not in _DEEPSPEED_KEYS}

    def loss_scaler(self) -> Optional[dict]:
        """The dynamic fp16 loss scaler in our scaler's terms, or None (static scale: fp32 and bf16 runs)."""
        state = self._optim_state(0)
        scaler = state.get("loss_scaler")
        if not state.get("dynamic_loss_scale") or scaler is None:
            return None
        values = vars(scaler)
        return {"scale": float(values["cur_scale"]), "hysteresis_left": int(values.get("cur_hysteresis", 1)),
                "iteration": int(values.get("cur_iter", 0)),
                "last_overflow": int(values.get("last_overflow_iter", -1))}

    def skipped_steps(self) -> int:
        return int(self.model_states.get("skipped_steps") or 0)

    # -- for an offline conversion to our format (foreign/to_zero.py) ----------------------------------------
    def dtype(self, name: str) -> torch.dtype:
        """The dtype the run trained ``name`` in (its 16-bit or fp32 model copy); a buffer's or frozen
        parameter's own."""
        value = (self.model_states.get("module") or {}).get(name)
        if torch.is_tensor(value):
            return value.dtype
        return torch.float32 if name in self._pieces else self.read_whole(name).dtype

    def origin(self) -> dict:
        return {"version": str(self.model_states.get("ds_version")), "stage": self.stage, "world_size": self.world,
                "tag": self.folder.name}

    def aliases(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in (self.model_states.get("shared_params") or {}).items()}


def _flat_states(base: Any, count: int, path: Path) -> list[dict]:
    """The torch optimizer state of each flat: the state ids, in the order the groups list them, are the flats
    in file order."""
    if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
        raise CheckpointError(f"'{path}' holds no optimizer state_dict (state and param_groups)")
    ids = [i for group in base["param_groups"] for i in group["params"]]
    if len(ids) != count:
        raise CheckpointError(f"'{path}': the optimizer's groups list {len(ids)} tensors, the file has {count} "
                              "fp32 partitions")
    return [base["state"].get(i, {}) for i in ids]


def _copied(value: Any) -> Any:
    """Tensors out of the memory-mapped file (it is closed after loading)."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return type(value)((k, _copied(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(v) for v in value)
    return value
