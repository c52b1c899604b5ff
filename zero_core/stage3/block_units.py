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
in ``zero_core.GatheredParameters``).
"""

from __future__ import annotations

from torch import nn

from zero_core.stage3.leaf_modules import leaf_of, z3_leaf_module


def _holds_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def is_block(module: nn.Module) -> bool:
    """A candidate block: parameters in more than one module of its subtree, and no leaf module in it."""
    modules = list(module.modules())
    if any(z3_leaf_module(m) for m in modules):
        return False
    return sum(1 for m in modules if _holds_params(m)) > 1


def block_of(model: nn.Module, inside_leaf: dict) -> dict[nn.Module, nn.Module]:
    """Each module inside a block (the block included) -> that block; leaves' subtrees are left out."""
    inside: dict[nn.Module, nn.Module] = {}
    for container in model.modules():
        if not isinstance(container, nn.ModuleList) or container in inside or container in inside_leaf:
            continue
        for child in container.children():
            if child in inside or child in inside_leaf or not is_block(child):
                continue
            for member in child.modules():
                inside.setdefault(member, child)
    return inside


def unit_owners(model: nn.Module) -> dict[str, str]:
    """Each module's name -> the name its parameters' stage 3 units are planned under: its block's for a module
    inside a block, else its own. The runtime and the estimator (tools/estimator.py) both read it, so the plan
    they make is one plan. Leaves must be declared before (they are not blocks)."""
    inside = block_of(model, leaf_of(model))
    names = {module: name for name, module in model.named_modules()}
    return {name: names[inside.get(module, module)] for name, module in model.named_modules()}
