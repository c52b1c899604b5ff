"""Stage 3's root group: the parameters of the modules outside every block, gathered by the root module's hooks.

A model's embeddings, final norm and head sit outside its blocks (block_units.py). Hooked one by one, each of
them costs a graph break under whole-model ``torch.compile`` (a ``torch.compiler.disable``d hook called inside
the compiled forward). FSDP2 folds such modules into its root's group, gathered by the root's hook before the
compiled frame starts; stage 3 does the same: the root's pre-forward gathers the group with its first
prefetch batch (one all-gather), the group stays gathered through the root's forward and, when a backward
follows, into it (FSDP2's root does not reshard after forward either), and the end of backward releases it.

The members keep their own hooks behind a ``Gate``: while the group is gathered the gate returns at once, and
dynamo traces it to nothing (a guard on one bool), so the compiled root forward has no break there. Whenever
the group is not gathered (a member called outside the root's forward after the group was released: after an
eval forward or an optimizer step, a submodule driven directly), the gate runs the member's own stage-3 hook,
exactly as without a group.

The group is formed only where it keeps the budgets meaningful: the model has blocks, and the group's elements
fit in ``max_live_parameters`` (prefetch counts the group as live, so the peak stays at most
``max_live_parameters`` plus one block). Members are the hooked modules below no ``ModuleList`` (modules of a
``ModuleList`` that are not blocks keep their own hooks) and no leaf module. docs/stage3.md (torch.compile)
says what this means for memory.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from zero_core.stage3.leaf_modules import z3_leaf_module


class RootGroup:
    """The member modules and whether their units are all gathered now (the gates read ``gathered``)."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.units: set = set()  # the members' units (own and external), set by the runtime
        self.gathered = False

    def __bool__(self) -> bool:
        return bool(self.members)


class Gate:
    """A member's stage-3 hook, run only while the root group is not gathered. Traced by dynamo inside a compiled
    root forward, where the group is gathered, it is a guard and no call (no graph break)."""

    def __init__(self, group: RootGroup, hook: Callable) -> None:
        self.group = group
        self.hook = hook

    def __call__(self, module, *rest):
        if self.group.gathered:
            return None
        return self.hook(module, *rest)


def below_module_lists(model: nn.Module) -> set[nn.Module]:
    """Every module inside an element of a ``ModuleList`` (blocks, and the layers of lists that are not blocks)."""
    inside: set[nn.Module] = set()
    for container in model.modules():
        if isinstance(container, nn.ModuleList):
            for child in container.children():
                inside.update(child.modules())
    return inside


def plan_root_group(model: nn.Module, hooked: list[nn.Module], blocks: set, units_of: Callable,
                    max_live_parameters: int) -> RootGroup:
    """The root group of ``model``: its hooked modules outside every block, list and leaf, when the model has
    blocks and their units' elements fit in ``max_live_parameters``; else an empty group (per-module hooks)."""
    if not blocks:
        return RootGroup([])
    listed = below_module_lists(model)
    members = [m for m in hooked if m is not model and m not in listed and not z3_leaf_module(m)]
    units = {u for m in members for u in units_of(m)}
    if sum(u.numel for u in units) > max_live_parameters:
        return RootGroup([])
    return RootGroup(members)
