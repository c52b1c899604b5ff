"""Stage 3 tiles: each tile of a ``TiledLinear`` (zero_core/tiling.py) is a unit of its own.

Tiling exists so that a layer too large to gather whole runs one tile at a time. So the unit plan keeps tiles
apart wherever they sit: a tile is never folded into an enclosing block's unit (block_units.py) nor into the
root group (root_group.py: tiles sit below ``ModuleList``s), and a tile's subtree (a ``linear_cls`` with
children) is one unit. The runtime releases a tile after its forward and after its backward (no reuse
distance, no root keep: after its input's gradient, or its own gradients when its input needs none,
gradients.py) and prefetches at most the next tile (prefetch.py). A ``TiledLinear`` inside a stage 3
leaf module is gathered with the leaf: the leaf's promise (one unit, no hooks below) wins.
"""

from __future__ import annotations

from torch import nn


def tile_of(model: nn.Module, inside_leaf: dict) -> dict[nn.Module, nn.Module]:
    """Each module in a tile's subtree (the tile included) -> the tile; tiles inside leaves are left out."""
    from zero_core.tiling import TiledLinear  # tiling.py imports stage 3 helpers lazily: no cycle either way

    inside: dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, TiledLinear) and module not in inside_leaf:
            for tile in module.tiles():
                for member in tile.modules():
                    inside.setdefault(member, tile)
    return inside


def tile_lists(model: nn.Module) -> set[nn.Module]:
    """The ``ModuleList``s that hold tiles (a ``TiledLinear``'s ``linears`` and its rows): never blocks."""
    from zero_core.tiling import TiledLinear

    lists: set[nn.Module] = set()
    for module in model.modules():
        if isinstance(module, TiledLinear):
            lists.add(module.linears)
            lists.update(module.linears.children())
    return lists
