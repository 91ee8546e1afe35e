#!/usr/bin/env bash
# Builds .whl/: the wheels the lent GPU box lacks (it has torch, transformers, tokenizers, safetensors,
# prometheus-client, pytest but no fastapi/uvicorn/pydantic/httpx). Python 3.12, x86-64, no network there.
# Every runtime dependency of pyproject.toml the box lacks, and their own requirements (pip show), at the
# versions of the local venv; pure-Python ones the box probably has through httpx/torch (anyio, click) too,
# since a newer copy in /tmp/site is harmless and a missing one fails the whole run.
# Usage on the GPU box: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
git check-ignore -q .whl/x.whl || echo 'note: .whl/ is not git-ignored here; add it to .gitignore' >&2
py=${PYTHON:-.venv/bin/python}
ver() { "$py" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
pkgs=(fastapi starlette uvicorn pydantic pydantic_core pydantic-settings annotated-types typing-inspection
      python-dotenv pytest-asyncio opentelemetry-api httptools
      annotated-doc click anyio uvloop pytest-timeout
      llguidance python-json-logger asgi-correlation-id prometheus-fastapi-instrumentator sse-starlette
      httpx httpcore h11 certifi idna   # httpx: the served and open-loop benchmark clients
      pyzmq msgspec   # KV cache events (kv_events/)
      vllm-router setproctitle orjson aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl)  # benchmarks/router_bench.py
# Not in the test venv: the comparison library capture_bench.py times against, and py-spy (served_throughput.py --py-spy-dir).
extra=(breakable-cuda-graphs==0.1.0 py-spy==0.4.3)
rm -rf .whl && mkdir -p .whl
specs=()
for p in "${pkgs[@]}"; do
  v=$(ver "$p"); [ -n "$v" ] || { echo "not in local venv: $p" >&2; exit 1; }
  specs+=("$p==$v")
done
# One pip call (one resolver start, not one per package). manylinux_2_31: llguidance's only Linux wheel
# (cp39-abi3, good for cp312); the box's glibc must be >= 2.31 (Ubuntu 20.04+): pip.log says if not.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${specs[@]}" "${extra[@]}"
ls .whl
# Completeness (here, before a GPU session): a bare CPython 3.12 installs .whl/ as the box does and imports it;
# see scripts/check_device_wheels.py for the box-side packages it needs next to /tmp/site.
