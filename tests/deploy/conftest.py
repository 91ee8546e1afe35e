"""Shared paths and tool lookup for the deployment tests (Dockerfile, Helm chart, deploy/ stack).

The external tools come from scripts/ci-deploy-deps.sh: promtool and prometheus from Debian's
`prometheus` package, hadolint and Helm's Go SDK (helm-python-sdk) from the `test` extra.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "graphcache"
DEPLOY = ROOT / "deploy"

INSTALL_HINT = "run scripts/ci-deploy-deps.sh (as root) to install it"


def find_tool(name: str) -> str | None:
    """A tool from the venv's bin dir (pip-installed wrappers) or PATH."""
    local = Path(sys.executable).parent / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def require_tool(name: str) -> str:
    """The tool's path; skip (naming the fix) only when it is absent, which CI rules out by running the script."""
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} not installed: {INSTALL_HINT}")
    return path
