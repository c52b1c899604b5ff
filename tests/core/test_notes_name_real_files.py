"""Notes that survive moves: every file a docstring, comment or doc page names exists.

A note that points at a file which was renamed or split sends a reader nowhere; notes name concepts (a class, a
function, a ``[Note: ...]``) or a path that exists. Project paths (``zero_core/...``, ``tests/...``, ``docs/...``)
must exist as written; a bare ``name.py`` in the code must be a file somewhere in the repository, unless it is one
of the user's or another project's files that the docs name on purpose (``FOREIGN``)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT_DIRS = ("zero_core/", "lightning_zero/", "accelerate_zero/", "benchmarks/", "tests/", "docs/")
CODE_DIRS = ("zero_core", "lightning_zero", "accelerate_zero", "benchmarks", "tests")
# Files of the user's scripts and of other projects (DeepSpeed, Accelerate, TRL) that the notes name on purpose.
FOREIGN = {"train.py", "script.py", "sft.py", "zero_to_fp32.py", "ds_to_universal.py", "universal_checkpoint.py",
           "test_script.py", "test_sync.py", "test_distributed_data_loop.py"}
REFERENCE = re.compile(r"(?<![\w./-])([\w./-]*?[\w-]+\.(?:py|md))\b")


def _repository_files() -> tuple[set[str], set[str]]:
    files = [p for p in ROOT.rglob("*") if ".git" not in p.parts and "__pycache__" not in p.parts]
    return {str(p.relative_to(ROOT)) for p in files}, {p.name for p in files}


def _problem(ref: str, paths: set[str], names: set[str]) -> bool:
    if ref.startswith(PROJECT_DIRS):
        return ref not in paths
    if "/" in ref:
        return False  # another project's path (accelerate/test_utils/..., torch's _fully_shard/...)
    return ref not in names and ref not in FOREIGN


def _code_notes(path: Path):
    """(line, text) of every string and comment of a Python file: docstrings included."""
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            yield token.start[0], token.string


def _doc_lines(path: Path):
    yield from enumerate(path.read_text().splitlines(), 1)


def test_every_file_a_note_names_exists():
    paths, names = _repository_files()
    sources = [(p, _code_notes(p)) for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))
               if p != Path(__file__).resolve()]  # this file names stale files on purpose
    sources += [(p, _doc_lines(p)) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    missing = [f"{path.relative_to(ROOT)}:{line}: {ref}"
               for path, notes in sources for line, text in notes
               for ref in REFERENCE.findall(text) if _problem(ref, paths, names)]
    assert not missing, "notes name files that do not exist (name the concept, or the path as it is now):\n" + \
        "\n".join(missing)


def test_the_check_sees_a_stale_note():
    paths, names = _repository_files()
    assert _problem("zero_core/stage12.py", paths, names)
    assert _problem("collective_guard.py", paths, names)
    assert not _problem("zero_core/engine.py" if "zero_core/engine.py" in paths else "zero_core/__init__.py",
                        paths, names)
    assert not _problem("train.py", paths, names)
