"""The front-ends build on the core's public surface only (``zero_core.__all__``, docs/core-api.md), and the
core knows nothing of them: no private core module imported by lightning_zero or accelerate_zero, no
Lightning/Fabric optimizer wrapper unwrapped inside zero_core."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import zero_core

ROOT = Path(__file__).resolve().parents[2]
FRONT_ENDS = ("lightning_zero", "accelerate_zero")


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _core_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every reach into zero_core: imports, and attributes of an imported ``zero_core``."""
    uses, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "zero_core" or alias.name.startswith("zero_core."):
                    uses.append((node.lineno, f"import {alias.name}"))
                    if alias.name == "zero_core":
                        aliases.add(alias.asname or "zero_core")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zero_core":
            for alias in node.names:
                uses.append((node.lineno, f"from {node.module} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.append((node.lineno, f"zero_core.{node.attr}"))
    return uses


def _private(use: str) -> bool:
    public = set(zero_core.__all__)
    if use.startswith("import "):
        return use != "import zero_core"
    if use.startswith("from "):
        module, name = re.fullmatch(r"from (\S+) import (\S+)", use).groups()
        return module != "zero_core" or name not in public
    return use.split(".", 1)[1] not in public


def test_front_ends_import_only_the_public_surface():
    offenders = []
    for package in FRONT_ENDS:
        for path in _sources(package):
            for line, use in _core_uses(ast.parse(path.read_text(), str(path))):
                if _private(use):
                    offenders.append(f"{path.relative_to(ROOT)}:{line}: {use}")
    assert not offenders, "front-ends reach past zero_core.__all__:\n" + "\n".join(offenders)


def test_scan_sees_private_imports():
    """The scan itself catches each form of reaching past the surface (so an empty result means something)."""
    source = ("import zero_core\nimport zero_core.registry\nfrom zero_core.checkpoint import save_checkpoint\n"
              "from zero_core import registry, setup\nzero_core.engine.ZeroEngine\nzero_core.setup\n")
    flagged = [use for _, use in _core_uses(ast.parse(source)) if _private(use)]
    assert sorted(flagged) == sorted(["import zero_core.registry", "from zero_core.checkpoint import save_checkpoint",
                                      "from zero_core import registry", "zero_core.engine"])


def test_public_surface_resolves():
    for name in zero_core.__all__:
        assert getattr(zero_core, name, None) is not None, name


def test_core_does_not_unwrap_front_end_optimizers():
    pattern = re.compile(r"LightningOptimizer|_FabricOptimizer|AcceleratedOptimizer|\._optimizer\b|\"_optimizer\"")
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _sources("zero_core")
             for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "the core unwraps a front-end's optimizer wrapper:\n" + "\n".join(found)
