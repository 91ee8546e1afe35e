"""Shared pytest setup: tests marked `cuda` are skipped where torch sees no CUDA device.

The marker itself is declared in pyproject.toml; run the GPU tests with `pytest -m cuda`.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
