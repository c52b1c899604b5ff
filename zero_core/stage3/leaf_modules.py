"""Stage 3 leaf modules: a module whose whole subtree is gathered and released as one unit.

DeepSpeed's meaning (``deepspeed.utils.set_z3_leaf_modules``, the ``zero_optimization.leaf_module`` block): stage 3
puts no hooks below a leaf, so the parameters of every descendant are gathered when the leaf's forward starts
and released after it, and the ranks' collectives stay in step even when the leaf runs different children on
different ranks (a mixture-of-experts block that skips experts without tokens). Their gradients are reduced at
the end of backward, in a fixed order. Declare leaves before ``zero_core.setup``: the hooks are placed there.

The flags live in a weak set here, not on the modules (no attributes hung on the user's objects).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence, Union

from torch import nn

_LEAVES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

ClassSpec = Union[type, str]


def _class_matches(module: nn.Module, spec: ClassSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(modules: Iterable[nn.Module], flag: bool) -> list[nn.Module]:
    marked = list(dict.fromkeys(modules))
    for module in marked:
        (_LEAVES.add if flag else _LEAVES.discard)(module)
    return marked


def _by_class(model: nn.Module, classes: Sequence[ClassSpec], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be classes or class names (plain or dotted), got {bad!r}")
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of the classes {[getattr(c, '__name__', c) for c in classes]} in the model "
                         f"({type(model).__name__}); check the class names (plain or dotted path)")
    return _mark(found, flag)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassSpec],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Declare every module of ``model`` of these classes (types, or names plain or dotted) a stage 3 leaf."""
    return _by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[ClassSpec],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Undo :func:`set_z3_leaf_modules` for these classes (before setup)."""
    return _by_class(model, leaf_module_classes, False, raise_if_not_found)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` declared leaves."""
    return [m for m in model.modules() if m in _LEAVES]


def z3_leaf_module(module: nn.Module) -> bool:
    return module in _LEAVES


def apply_leaf_config(model: nn.Module, classes: Sequence[str], names: Sequence[str],
                      name_suffixes: Sequence[str]) -> list[nn.Module]:
    """The ``zero_optimization.leaf_module`` block: classes (names plain or dotted), module names as in
    ``named_modules()``, and name suffixes. A name or suffix that matches nothing is an error."""
    named = dict(model.named_modules())
    missing = [n for n in names if n not in named]
    missing += [s for s in name_suffixes if not any(n.endswith(s) for n in named)]
    if missing:
        raise ValueError(f"zero_optimization.leaf_module names no module of the model: {missing}; use names from "
                         "model.named_modules() (e.g. 'layers.0.block_sparse_moe')")
    found = _by_class(model, classes, True, raise_if_not_found=False)
    found += _mark([named[n] for n in names], True)
    found += _mark([m for n, m in named.items() if any(n.endswith(s) for s in name_suffixes)], True)
    return list(dict.fromkeys(found))


def leaf_of(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each module strictly inside a leaf's subtree -> its outermost enclosing leaf."""
    inside: dict[nn.Module, nn.Module] = {}
    for module in model.modules():
        if module in _LEAVES and module not in inside:
            for child in module.modules():
                if child is not module:
                    inside.setdefault(child, module)
    return inside
