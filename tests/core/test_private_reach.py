"""No module reaches into another package's private members (issue 35: "one room per concern").

A *wing* (docs/core-api.md's module map) is a package of the core: ``zero_core.stage3``, ``zero_core.engine``,
``zero_core.checkpoint`` and, apart from it, ``zero_core.checkpoint.foreign``; each module directly in
``zero_core/`` is a wing of its own (``zero_core.join``, ``zero_core.planning``: unrelated shared pieces, each a
concern of its own), and ``zero_core/__init__.py`` is the wing ``zero_core``. Each front-end (``lightning_zero``,
``accelerate_zero``) is one wing: its modules adapt one framework and share that adapter's state.

Flagged, read from the sources only (no imports, no processes):
- ``expr._name`` (one leading underscore) where ``expr`` is not ``self``/``cls`` and ``_name`` is defined (set
  as ``self._name``, a class-body name, or a method) only in classes of other wings. A name defined in the
  accessing wing too is taken as its own; names torch's own classes define (``module._buffers``,
  ``tensor._version``, ``optimizer._optimizer_step_pre_hooks``) are torch's, not a wing's.
- ``from zero_core.x import _name``, and ``module._name`` on an imported core module, across wings.

The fix for a finding: give the owner a public verb or property and call that.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("zero_core", "lightning_zero", "accelerate_zero")


def wing_of(module: str, packages: frozenset = frozenset()) -> str:
    """The wing of ``module`` (``packages``: the names that are packages, their ``__init__.py``)."""
    parts = module.split(".")
    if parts[0] != "zero_core":
        return parts[0]
    return module if module in packages or len(parts) <= 2 else ".".join(parts[:-1])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_names() -> set[str]:
    """Private names torch's base classes define: a subclass or a caller using them uses torch's, not ours."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return {n for obj in (nn.Module(), torch.Tensor, optimizer) for n in dir(obj) if _private(n)}


def class_members(tree: ast.Module) -> set[str]:
    """Private names a module's classes define: ``self._x = ...``, class-body names, methods."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _private(n)}


def _module_aliases(tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """Local names bound to core modules (``import zero_core.x as m``, ``from zero_core import x``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def reaches(sources: dict[str, str], packages: frozenset = frozenset()) -> list[str]:
    """Each reach across wings in ``sources`` (module name -> source; ``packages``: those that are packages),
    as 'module:line: what'."""
    wing_in = functools.partial(wing_of, packages=packages)
    trees = {module: ast.parse(text) for module, text in sources.items()}
    modules = set(trees)
    torch_names = _torch_names()
    owners: dict[str, set[str]] = defaultdict(set)  # private class member -> the wings defining it
    for module, tree in trees.items():
        for name in class_members(tree) - torch_names:
            owners[name].add(wing_in(module))
    found = []
    for module, tree in sorted(trees.items()):
        wing, aliases = wing_in(module), _module_aliases(tree, modules)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PACKAGES
                    and wing_in(node.module) != wing):
                found += [f"{module}:{node.lineno}: from {node.module} import {alias.name}"
                          for alias in node.names if _private(alias.name)]
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            where = f"{module}:{node.lineno}: {ast.unparse(node)}"
            value = ast.unparse(node.value)
            target = aliases.get(value) or (value if value in modules else None)
            if target is not None:
                if wing_in(target) != wing:
                    found.append(f"{where} (a private name of module {target})")
            elif owners.get(node.attr) and wing not in owners[node.attr]:
                found.append(f"{where} (private to {', '.join(sorted(owners[node.attr]))})")
    return list(dict.fromkeys(found))  # an augmented write reads the name too


def core_sources() -> tuple[dict[str, str], frozenset]:
    """Every module's source by module name, and the names that are packages."""
    sources, packages = {}, set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            sources[module] = path.read_text()
            if parts[-1] == "__init__":
                packages.add(module)
    return sources, frozenset(packages)


def test_no_module_reaches_into_another_packages_private_members():
    found = reaches(*core_sources())
    assert not found, ("these reach into another package's private members; give the owner a public verb or "
                       "property and call that:\n" + "\n".join(found))


def test_the_check_sees_each_kind_of_reach():
    sources = {
        "zero_core.stage3.runtime": (
            "class R:\n"
            "    _limit = 3\n"
            "    def __init__(self):\n"
            "        self._units = []\n"
            "    def _gather(self):\n"
            "        return self._units, self._limit\n"
            "def _helper():\n"
            "    pass\n"),
        "zero_core.stage3.prefetch": "def g(r):\n    return r._units, r._gather()\n",  # the same wing
        "zero_core.offload.swap": "class S:\n    def __init__(self):\n        self._version = 0\n",
        "zero_core.engine.step": (
            "from zero_core.stage3.runtime import _helper, R\n"
            "from zero_core.stage3 import runtime\n"
            "import zero_core.stage3.runtime as rt\n"
            "def f(r, t, m):\n"
            "    r._units.append(r._limit)\n"
            "    r._gather()\n"
            "    runtime._helper(); rt._helper()\n"
            "    return t._version, m.__dict__, r._not_ours, self_like.public\n"),  # torch's, dunder, unknown
        "lightning_zero.strategy": "class Z:\n    def f(self, other):\n        return other._units\n",
        "zero_core.checkpoint.sources": "def _rows():\n    pass\n",
        "zero_core.checkpoint.foreign.dcp": "from zero_core.checkpoint.sources import _rows\n",  # a sub-package
    }
    found = sorted(line.split(" (")[0] for line in reaches(sources, frozenset({"zero_core.checkpoint.foreign"})))
    assert found == [
        "lightning_zero.strategy:3: other._units",
        "zero_core.checkpoint.foreign.dcp:1: from zero_core.checkpoint.sources import _rows",
        "zero_core.engine.step:1: from zero_core.stage3.runtime import _helper",
        "zero_core.engine.step:5: r._limit",
        "zero_core.engine.step:5: r._units",
        "zero_core.engine.step:6: r._gather",
        "zero_core.engine.step:7: rt._helper",
        "zero_core.engine.step:7: runtime._helper",
    ]


def test_wings():
    _, packages = core_sources()
    wing = functools.partial(wing_of, packages=packages)
    assert wing("zero_core.stage3.runtime") == wing("zero_core.stage3") == "zero_core.stage3"
    assert wing("zero_core.checkpoint.foreign.dcp") == wing("zero_core.checkpoint.foreign") != \
        wing("zero_core.checkpoint.save")
    assert wing("zero_core.join") != wing("zero_core.planning")
    assert wing("zero_core") == "zero_core"
    assert wing("accelerate_zero.state_io") == wing("accelerate_zero.accelerator")
