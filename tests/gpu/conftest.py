"""The GPU tier: tests marked ``cuda`` run only where CUDA is available (``python -m pytest tests/gpu``); on a
CPU-only machine they are skipped, and every other test runs on CPU wherever it runs."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
