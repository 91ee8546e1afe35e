"""Shared pytest setup: tests marked `cuda` are skipped where torch sees no CUDA device.

The marker itself is declared in pyproject.toml; run the GPU tests with `pytest -m cuda`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton decode kernel's CPU tests run in Triton's interpreter, which must be on before triton
    # is first imported (any test module importing the model may import it during collection).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
