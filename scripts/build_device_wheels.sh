#!/usr/bin/env bash
# Builds .whl/: the wheels the lent GPU box lacks (it has torch, transformers, tokenizers, safetensors,
# prometheus-client, httpx, pytest but no fastapi/uvicorn/pydantic). Python 3.12, x86-64, no network there.
# Usage on the GPU box: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
py=${PYTHON:-.venv/bin/python}
ver() { "$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
pkgs=(fastapi starlette uvicorn pydantic pydantic_core pydantic-settings annotated-types typing-inspection
      python-dotenv pytest-asyncio opentelemetry-api httptools)
# Not in the test venv: the comparison library capture_bench.py times against.
extra=(breakable-cuda-graphs==0.1.0)
rm -rf .whl && mkdir -p .whl
for p in "${pkgs[@]}"; do
  v=$(ver "$p"); [ -n "$v" ] || { echo "not in local venv: $p" >&2; exit 1; }
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$p==$v"
done
for spec in "${extra[@]}"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "$spec"
done
ls .whl
