"""Shared test setup: how the tests are laid out and how their modules find each other.

Layout: one folder per area (core, stage3, offload, checkpoint, lightning, accelerate, multinode, reliability; gpu/
is the CUDA tier with its own conftest), the launched scripts next to their front-end's tests (core/scripts,
lightning/scripts, accelerate/scripts), and every shared helper in support/ (``distributed``: the multi-process
harness; ``launch``: launching scripts and launchers as subprocesses; ``models``, ``reference``, ...).

Imports: no folder is a package. pytest's rootdir-relative "prepend" import mode puts each test file's own folder
on sys.path and imports it by its basename, so test basenames are unique across folders, and a test module may
import another test module of its own folder by name. This file puts support/ on sys.path, so a helper is imported
by its bare name (``from distributed import run_distributed``) from any folder. Ranks started by ``run_distributed``
(forks of multiprocessing's fork server, which starts after collection) get the parent's sys.path and import the
worker's module by the same name; scripts started as subprocesses get support/ and the repository on PYTHONPATH
from ``launch.child_env``.
"""

import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))


def pytest_sessionstart(session):
    """Two modules of one basename (tests or helpers; not the launched scripts) would be one module to pytest and to
    spawned ranks: say so up front instead of pytest's "import file mismatch"."""
    tests = SUPPORT.parent
    seen: dict[str, str] = {}
    for path in sorted(tests.rglob("*.py")):
        parts = path.relative_to(tests).parts
        if path.name == "conftest.py" or {"scripts", "fixtures", "__pycache__"} & set(parts[:-1]):
            continue
        if path.name in seen:
            raise pytest.UsageError(f"{seen[path.name]} and tests/{'/'.join(parts)} share a module name; rename one "
                                    "(tests and helpers are imported by their basename, see tests/conftest.py)")
        seen[path.name] = f"tests/{'/'.join(parts)}"
