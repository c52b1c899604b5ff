"""``activation_checkpointing_policy``: FSDPStrategy's switch, with the same meaning, for the ZeRO strategies.

Lightning's FSDP wraps each matching submodule in torch's ``CheckpointWrapper``; here the module stays where it
is (its parameter names, the plan of stage 3 units and checkpoints do not change) and only its ``forward`` is
replaced, on the instance, by one that runs the original under ``zero_core.checkpointing.checkpoint``. So the
config's ``activation_checkpointing`` block applies (``cpu_checkpointing``, contiguous buffers, ...), and at
stage 3 the recomputation finds the module's parameters gathered by the backward hooks (docs/stage3.md,
"Activation checkpoints").
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn

import zero_core

# A set of module classes, an FSDP policy object (ModuleWrapPolicy, CustomPolicy) or an FSDP policy function
# ``fn(module, recurse, nonwrapped_numel) -> bool``, as FSDPStrategy(activation_checkpointing_policy=...) takes.
Policy = Union[set, Callable[..., bool], Any]


class CheckpointedForward:
    """A module's original ``forward`` run under the engine's activation checkpoint (picklable, unlike a closure)."""

    def __init__(self, forward: Callable) -> None:
        self.original = forward

    def __call__(self, *args, **kwargs):
        return zero_core.checkpointing.checkpoint(self.original, *args, **kwargs)


def check_policy(policy: Optional[Policy], owner: str) -> Optional[Policy]:
    """The policy as given, once it is of a kind ``matching_modules`` can read; a clear error otherwise."""
    if policy is None or callable(policy) or hasattr(policy, "_run_policy"):
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)):
        if not policy or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
            raise TypeError(f"{owner}(activation_checkpointing_policy={policy!r}): give a non-empty set of "
                            "nn.Module classes (such as {Block}), an FSDP policy (ModuleWrapPolicy, CustomPolicy) "
                            "or a function (module, recurse, nonwrapped_numel) -> bool")
        return set(policy)
    raise TypeError(f"{owner}(activation_checkpointing_policy=...) got a {type(policy).__name__}: give a set of "
                    "nn.Module classes, an FSDP policy (ModuleWrapPolicy, CustomPolicy) or a function "
                    "(module, recurse, nonwrapped_numel) -> bool")


def matching_modules(root: nn.Module, policy: Policy) -> list[nn.Module]:
    """The submodules ``policy`` selects, outermost first; one inside another selected one is left out (the
    outer recomputation reruns it anyway). As in FSDP: a set of classes matches instances (the root too); a
    policy function is asked for every module but the root with ``recurse=False``."""
    if isinstance(policy, set):
        classes = tuple(policy)
        selected = [m for m in root.modules() if isinstance(m, classes)]
    elif hasattr(policy, "_run_policy"):  # torch.distributed.fsdp.wrap._Policy: what FSDP itself calls
        chosen = policy._run_policy(root, ignored_modules=set(), root_kwargs={})
        selected = [m for m in root.modules() if m in chosen]
    else:
        selected = [m for m in root.modules() if m is not root
                    and policy(module=m, recurse=False, nonwrapped_numel=sum(p.numel() for p in m.parameters()))]
    inner = {id(d) for m in selected for d in m.modules() if d is not m}
    return [m for m in selected if id(m) not in inner]


def apply_activation_checkpointing(root: nn.Module, policy: Optional[Policy]) -> int:
    """Checkpoint the forward of each module ``policy`` selects in ``root``; returns how many run checkpointed
    (a module already checkpointed, by an earlier fit, is counted and left as it is)."""
    if policy is None:
        return 0
    count = 0
    for module in matching_modules(root, policy):
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module.forward)
        count += 1
    return count
