"""Stage 3 block units: each block of a ``nn.ModuleList`` (a transformer layer, a residual block) is hooked as one.

Hooks per ``Linear`` and ``LayerNorm`` cost host time on every module of every step (a pre- and a post-forward
hook, a backward hook pair, trace bookkeeping), and under ``block.compile()`` each would be a graph break inside
the compiled block. So stage 3 puts its hooks on the block, as FSDP2 does with ``fully_shard`` per block: the
block's forward gathers the units of its whole subtree (one coalesced all-gather), and they are released after
it; backward likewise. A block's parameters are also one unit per optimizer group and dtype (``unit_owners``):
every gather, release and reduction then does its per-unit Python once per block, not once per module.
Checkpoints hold parameters by name (fragments), not units, so they load across this grouping. A child that some rank does not run inside a block (an ``if`` on the data) is
covered: its gradients count as complete once the block's backward is over (zeros on that rank, as DDP's
``find_unused_parameters``).

A block is a direct child of a ``ModuleList`` (the outermost one) whose subtree has parameters in more than one
module. Blocks that contain a leaf module (leaf_modules.py) keep per-module hooks outside the leaf, since a leaf's
own deferred reduction is what keeps rank-dependent children in step. A block's submodules must run inside the
block's forward (calling ``model.blocks[0].mlp(x)`` directly finds its parameters partitioned; wrap such code
in ``zero_core.GatheredParameters``). The tiles of a ``TiledLinear`` stay out of every block: each is a unit of
its own, hooked on its own, even inside a block that is otherwise one unit (tile_units.py).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from zero_core.stage3.leaf_modules import leaf_of, z3_leaf_module
from zero_core.stage3.tile_units import tile_lists, tile_of


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def is_block(module: nn.Module, tiles: Optional[dict] = None) -> bool:
    """A candidate block: parameters in more than one module of its subtree (tiles not counted: they are units
    of their own), and no leaf module in it."""
    modules, tiles = list(module.modules()), tiles or {}
    if any(z3_leaf_module(m) for m in modules):
        return False
    return sum(1 for m in modules if _holds_params(m) and m not in tiles) > 1


def block_of(model: nn.Module, inside_leaf: dict, tiles: Optional[dict] = None) -> dict[nn.Module, nn.Module]:
    """Each module inside a block (the block included) -> that block; leaves' subtrees and tiles (``tiles``:
    tile_units.tile_of) are left out."""
    inside: dict[nn.Module, nn.Module] = {}
    tiles = tiles or {}
    skipped = tile_lists(model) if tiles else set()
    for container in model.modules():
        if (not isinstance(container, nn.ModuleList) or container in inside or container in inside_leaf
                or container in skipped):
            continue
        for child in container.children():
            if child in inside or child in inside_leaf or child in tiles or not is_block(child, tiles):
                continue
            for member in child.modules():
                if member not in tiles:
                    inside.setdefault(member, child)
    return inside


def unit_owners(model: nn.Module) -> dict[str, str]:
    """Each module's name -> the name its parameters' stage 3 units are planned under: its tile's for a module
    inside a ``TiledLinear`` tile, its block's for a module inside a block, else its own. The runtime and the
    estimator (tools/estimator.py) both read it, so the plan they make is one plan. Leaves must be declared
    before (they are not blocks)."""
    inside_leaf = leaf_of(model)
    tiles = tile_of(model, inside_leaf)
    inside = {**block_of(model, inside_leaf, tiles), **tiles}
    names = {module: name for name, module in model.named_modules()}
    return {name: names[inside.get(module, module)] for name, module in model.named_modules()}
