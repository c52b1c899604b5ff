"""What a sharded optimizer's ``state_dict()`` is: whose shard, of which topology, over which layout.

``ShardedOptimizer.state_dict()`` is this rank's shard only: its per-element tensors are indexed by this rank's
fp32 master shards, so it means something only to the same rank of the same topology over the same layout.
The entry ``SHARD_KEY`` it carries (plain lists and numbers, so ``torch.load(weights_only=True)`` reads it)
says so, and :func:`check_loadable` turns every other load (another rank's shard, another world size or layout,
a partial state, a whole unsharded torch optimizer state) into an error that names the fix, where torch's own
``load_state_dict`` would load it silently into the wrong elements.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from zero_core.contracts import CheckpointedEngine

SHARD_KEY = "zero_shard"
FORMAT = "zero_core.optimizer_shard/1"

_PORTABLE_FIX = (
    "For an optimizer state that loads on any rank, world size or stage, save and load through the engine: "
    "engine.save_checkpoint/load_checkpoint (Accelerate: accelerator.save_state/load_state; Lightning and "
    "Fabric: their checkpoints; a Hugging Face Trainer under accelerate_zero.swap: its save_steps checkpoints)"
)


def describe(engine: CheckpointedEngine, index: int) -> dict[str, Any]:
    """The identity of optimizer ``index``'s shard on this rank: topology, and for each of its parameter groups
    each master shard's size and the parameter pieces it holds (name, shape, element range)."""
    pieces: dict[int, list] = {}
    for fragment in engine.fragments(index):
        pieces.setdefault(id(fragment.master), []).append(
            [fragment.name, list(fragment.shape), [fragment.param_range.start, fragment.param_range.end]])
    groups = [[{"numel": master.numel(), "params": pieces.get(id(master), [])} for master in group["params"]]
              for group in engine.inner_optimizers[index].param_groups]
    return {
        "format": FORMAT,
        "rank": engine.topology.rank,
        "world_size": engine.topology.world_size,
        "stage": engine.config.stage,
        "optimizer": index,
        "layout_fingerprint": fingerprint(groups),
        "groups": groups,
    }


def fingerprint(groups: list) -> str:
    return hashlib.sha256(json.dumps(groups, sort_keys=True).encode()).hexdigest()[:16]


def stamp(state: dict, identity: dict) -> dict:
    """``state`` (an inner optimizer's ``state_dict()``) with its identity and which entries hold state."""
    return {**state, SHARD_KEY: {**identity, "stateful": sorted(int(i) for i in state["state"])}}


def check_loadable(state_dict: Any, expected: dict, optimizer_name: str) -> dict:
    """The inner optimizer's part of ``state_dict`` if it is this rank's shard of this layout; else raise."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = list(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{optimizer_name}.load_state_dict needs an optimizer state_dict() with 'state' and "
                         f"'param_groups', got {keys}")
    saved = state_dict.get(SHARD_KEY)
    if saved is None:
        raise ValueError(
            f"{optimizer_name}.load_state_dict got a plain torch optimizer state (no '{SHARD_KEY}' entry), e.g. "
            "a whole one saved by DDP or one process, or an old shard: loading it would put whole-parameter "
            "state into this rank's shard. Load a whole optimizer state into the engine with "
            "zero_core.checkpoint.load_full_state_dict(engine, model_state, optimizer_state=...) (Accelerate: "
            f"accelerator.load_state of a plain save_state directory). {_PORTABLE_FIX}"
        )
    _check_topology(saved, expected, optimizer_name)
    _check_layout(saved, expected, optimizer_name)
    inner = {k: v for k, v in state_dict.items() if k != SHARD_KEY}
    _check_complete(inner, saved, expected, optimizer_name)
    return inner


def _check_topology(saved: dict, expected: dict, name: str) -> None:
    if (saved.get("rank"), saved.get("world_size")) != (expected["rank"], expected["world_size"]):
        raise ValueError(
            f"{name}.load_state_dict got the optimizer shard of rank {saved.get('rank')} of "
            f"{saved.get('world_size')} (stage {saved.get('stage')}), but this is rank {expected['rank']} of "
            f"{expected['world_size']}: each rank holds a different slice of the optimizer state, so each rank "
            f"must load the state_dict() it saved itself, in the same topology. {_PORTABLE_FIX}"
        )


def _check_layout(saved: dict, expected: dict, name: str) -> None:
    if saved.get("layout_fingerprint") == expected["layout_fingerprint"] and saved.get("groups") == expected["groups"]:
        return
    where = _first_difference(saved.get("groups") or [], expected["groups"])
    raise ValueError(
        f"{name}.load_state_dict got a shard of another layout (saved at stage {saved.get('stage')}, loading at "
        f"stage {expected['stage']}; {where}): the model, its optimizer groups or the ZeRO partitioning settings "
        f"differ from when it was saved. Build them as before. {_PORTABLE_FIX}"
    )


def _first_difference(saved: list, expected: list) -> str:
    if len(saved) != len(expected):
        return f"{len(saved)} parameter groups saved, {len(expected)} here"
    for g, (a, b) in enumerate(zip(saved, expected)):
        if len(a) != len(b):
            return f"group {g} holds {len(a)} master shards saved, {len(b)} here"
        for m, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"group {g}, master shard {m}: saved {_pieces(x)}, here {_pieces(y)}"
    return "the layout fingerprints differ"


def _pieces(master: dict) -> str:
    params = ", ".join(f"'{n}' {tuple(s)} [{r[0]}:{r[1]}]" for n, s, r in master.get("params", [])[:3])
    return f"{master.get('numel')} elements ({params or 'no parameter'})"


def _check_complete(inner: dict, saved: dict, expected: dict, name: str) -> None:
    """Every group and every entry that held state when saved is there, each per-element tensor of its size."""
    sizes = [master["numel"] for group in expected["groups"] for master in group]
    counts = [len(group.get("params", [])) for group in inner["param_groups"]]
    if counts != [len(group) for group in expected["groups"]]:
        raise ValueError(f"{name}.load_state_dict got a partial state: its param_groups hold {counts} entries, "
                         f"the shard it claims to be holds {[len(g) for g in expected['groups']]}. "
                         "Load the whole state_dict() this rank saved")
    present = sorted(int(i) for i in inner["state"])
    if present != saved.get("stateful"):
        raise ValueError(f"{name}.load_state_dict got a partial state: 'state' has entries {present}, but "
                         f"{saved.get('stateful')} held state when it was saved. Load the whole state_dict() this "
                         "rank saved")
    for index, entry in inner["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() != sizes[int(index)]:
                raise ValueError(f"{name}.load_state_dict: state[{index}][{key!r}] has {value.numel()} elements "
                                 f"where this rank's master shard has {sizes[int(index)]}; the state is damaged "
                                 "or from another layout")
