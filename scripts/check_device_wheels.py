"""Completeness check of .whl/ (scripts/build_device_wheels.sh) on a Python 3.12 without torch.

The GPU box has torch, transformers, tokenizers, safetensors, prometheus-client, httpx, pytest and what
they pull in; .whl/ must bring everything else graphcache imports. Run with a bare CPython 3.12 whose
sys.path holds only the box-installed wheels (--target dir) and the box-side pure packages (BOX_HAS):

  python3.12 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:/tmp/box:service python3.12 -s scripts/check_device_wheels.py

It (1) imports every wheel's top-level module (a wheel whose own requirement is missing fails here), and
(2) scans service/graphcache, benchmarks and the cuda-marked tests for third-party imports: each must be
importable or be one the box has. It cannot import graphcache itself (no torch for 3.12 here).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the box has (its packages and their usual requirements), by import name.
BOX_HAS = {
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "prometheus_client",
    "httpx",
    "httpcore",
    "pytest",
    "_pytest",
    "numpy",
    "jinja2",
    "markupsafe",
    "yaml",
    "huggingface_hub",
    "filelock",
    "requests",
    "packaging",
    "h11",
    "idna",
    "certifi",
    "typing_extensions",
    "sympy",
    "networkx",
    "fsspec",
    "regex",
    "tqdm",
    "triton",
    "sniffio",
    "pluggy",
    "iniconfig",
    "pygments",
}
WHEEL_MODULES = [
    "fastapi",
    "starlette",
    "uvicorn",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "pydantic",
    "pydantic_settings",
    "llguidance",
    "pythonjsonlogger.json",
    "asgi_correlation_id",
    "prometheus_fastapi_instrumentator",
    "sse_starlette",
    "pytest_asyncio",
    "pytest_timeout",
    "anyio",
    "click",
    "dotenv",
    "annotated_doc",
    "opentelemetry",
]
# Optional in their importers (guarded by try/except ImportError) or CPU/CI-only tools.
OPTIONAL = {"breakable_cuda_graphs", "jsonschema", "openai", "schemathesis", "lm_eval", "helm", "hypothesis"}


def third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    local = {"graphcache", "benchmarks", "helpers_model", "tests", "conftest"} | {
        p.stem for p in ROOT.glob("tests/*.py")
    }
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def main() -> int:
    failed = []
    for mod in WHEEL_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            failed.append(f"wheel module {mod}: {type(e).__name__}: {e}")
    files = [
        *ROOT.glob("service/graphcache/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tests/gpu/*.py"),
        *(p for p in ROOT.glob("tests/*.py") if "mark.cuda" in p.read_text()),
    ]
    needed: dict[str, str] = {}
    for f in files:
        for name in third_party_imports(f):
            needed.setdefault(name, str(f.relative_to(ROOT)))
    for name, where in sorted(needed.items()):
        if name in BOX_HAS or name in OPTIONAL:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{name} (imported by {where}): {type(e).__name__}: {e}")
    print(
        f"python {sys.version.split()[0]}; {len(WHEEL_MODULES)} wheel modules, {len(needed)} third-party "
        f"imports in {len(files)} files ({len(needed) - len(needed.keys() & (BOX_HAS | OPTIONAL))} not on the box)"
    )
    for line in failed:
        print("MISSING", line)
    print("WHEELS COMPLETE" if not failed else "WHEELS INCOMPLETE")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
