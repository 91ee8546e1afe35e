#!/usr/bin/env bash
# Sets up a CPU-only test environment in .venv and runs the whole test suite (CUDA tests skip without a GPU).
# torch is pinned to a CPU build here only: this setup is for CPU machines (CI). Real installs stay unpinned.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
./scripts/ci-deploy-deps.sh  # promtool/prometheus (Debian) for the deploy tests
.venv/bin/ruff check service tests benchmarks scripts
.venv/bin/ruff format --check service tests benchmarks scripts
.venv/bin/mypy   # the whole package ([tool.mypy] in pyproject.toml)
exec .venv/bin/python -m pytest -q "$@"
