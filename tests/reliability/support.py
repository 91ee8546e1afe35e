"""Helpers of the reliability suite: a real server process on a free loopback port, metrics
scraping, error-body checks, and the load generator (benchmarks/load.py) imported as a library.

Every wait here has a deadline: a server that hangs fails the test, it never hangs the suite.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON) if _VENV_PYTHON.exists() else sys.executable
ADMIN_TOKEN = "reliability-admin-token-3f9c"

# Strings that would mean an error body leaks internals: a traceback, a source file, a checkout path.
LEAK_MARKERS = ("Traceback", '.py"', ".py:", "/work/", str(REPO), "site-packages", 'File "')


def _load_benchmark_module():
    """benchmarks/ is not a package (it is a script folder); load load.py under a unique name."""
    name = "graphcache_benchmarks_load"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


load = _load_benchmark_module()


def free_port() -> int:
    """A port nobody listens on right now (the server binds it a moment later; a clash is very unlikely
    on a CI box and shows up as a clear startup failure, not a hang)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


try:
    # Loaded here, in the parent: the child between fork and exec must not dlopen (a lock another
    # thread held at fork time would deadlock it).
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: if pytest dies (even SIGKILL), the kernel kills the server too,
    so a crashed test run never leaves a server holding a port and two cores."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def settings_env(settings: dict[str, Any]) -> dict[str, str]:
    """{"max_num_seqs": 2, "warmup_decode_sizes": [1, 2]} -> GRAPHCACHE_* env (lists as JSON, as
    pydantic-settings reads them)."""
    env = {}
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, (list, dict)):
            text = json.dumps(value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        env["GRAPHCACHE_" + key.upper()] = text
    return env


class ServerProcess:
    """`python -m graphcache.cli serve --port N` with settings passed as GRAPHCACHE_* env."""

    def __init__(self, cache_dir: Path, log_dir: Path, name: str = "server", **settings: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.settings = {
            "admin_token": ADMIN_TOKEN,
            "cache_dir": str(cache_dir),
            "host": "127.0.0.1",
            "log_level": "warning",
            **settings,
        }
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        # What runs `serve --port N`: a test may swap in a script that patches the server, then calls
        # graphcache.cli.main() (`python -c SCRIPT serve ...` passes `serve ...` as sys.argv[1:]).
        self.command = [PYTHON, "-m", "graphcache.cli"]

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings['admin_token']}"}

    def start(self, ready_timeout_s: float = 120.0) -> ServerProcess:
        env = {**os.environ, **settings_env(self.settings)}
        # Tests decide every setting: a GRAPHCACHE_* left in the caller's shell must not leak in.
        for key in list(env):
            if key.startswith("GRAPHCACHE_") and key not in settings_env(self.settings):
                del env[key]
        env["PYTHONUNBUFFERED"] = "1"
        # Two CI cores: one torch thread keeps the engine from fighting the event loop and the test.
        env.setdefault("OMP_NUM_THREADS", "1")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [*self.command, "serve", "--port", str(self.port)],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(self.base_url + "/ready", timeout=2.0)
                if response.status_code == 200:
                    return
                last = f"/ready {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready within {timeout_s}s ({last}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM only: the graceful path under test (drain, then exit)."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s: the process is gone when this returns."""
        if self.proc is None:
            return None
        try:
            self.terminate()
            code = self.wait_exit(grace_s)
            if code is None:
                self.kill()
            return code
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    # --- observation -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        response = httpx.get(self.base_url + "/metrics", timeout=5.0)
        response.raise_for_status()
        return response.text

    def metrics(self) -> Metrics:
        return Metrics(self.metrics_text())

    def cache_info(self) -> dict:
        response = httpx.get(self.base_url + "/admin/cache", headers=self.admin_headers, timeout=10.0)
        response.raise_for_status()
        return response.json()

    def wait_idle(self, timeout_s: float = 20.0) -> Metrics:
        """Until nothing runs or waits and every KV block is back; returns the idle metrics."""
        deadline = time.monotonic() + timeout_s
        metrics = self.metrics()
        while time.monotonic() < deadline:
            metrics = self.metrics()
            if (
                metrics.value("graphcache_num_requests_running") == 0
                and metrics.value("graphcache_num_requests_waiting") == 0
                and metrics.value("graphcache_kv_cache_usage_ratio") == 0
            ):
                return metrics
            time.sleep(0.1)
        raise AssertionError(
            f"{self.name} not idle within {timeout_s}s: running="
            f"{metrics.value('graphcache_num_requests_running')} waiting="
            f"{metrics.value('graphcache_num_requests_waiting')} kv="
            f"{metrics.value('graphcache_kv_cache_usage_ratio')}"
        )


class Metrics:
    """A parsed /metrics scrape: value(sample_name, **labels), e.g.
    value("graphcache_requests_finished_total", reason="abort")."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        if key in self.samples:
            return self.samples[key]
        if default is not None:
            return default
        raise KeyError(f"no sample {name}{labels or ''} in /metrics")


# --- error bodies ---------------------------------------------------------------------------------------


def assert_clean_error(
    response: httpx.Response, status: int | tuple[int, ...] | None = None, check_leaks: bool = True
) -> dict:
    """An OpenAI-shaped JSON error that leaks nothing (check_leaks=False: shape only, for bodies a
    separate, known-failing test checks); returns its `error` object."""
    expected = (status,) if isinstance(status, int) else status
    if expected is not None:
        assert response.status_code in expected, (
            f"expected {expected}, got {response.status_code}: {response.text[:300]}"
        )
    assert 400 <= response.status_code < 600, response.status_code
    if check_leaks:
        assert_no_leak(response.text)
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict), body
    assert {"message", "type", "param", "code"} <= set(error), body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    return error


def assert_no_leak(text: str) -> None:
    for marker in LEAK_MARKERS:
        assert marker not in text, f"error body leaks {marker!r}: {text[:500]}"


def completion_body(prompt: str = "hello", max_tokens: int = 8, **extra: Any) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


# --- an in-process server: the engine object is reachable (failpoints), HTTP is still real ----------


class InProcessServer:
    """create_app + uvicorn on a thread, on a free loopback port.

    For faults only reachable through Python objects (the graph cache's failpoint, the engine's step
    failpoint): the test holds `engine` and `metrics` while clients talk real HTTP to `base_url`.
    """

    def __init__(self, cache_dir: Path, **settings: Any) -> None:
        from graphcache.config import Settings
        from graphcache.metrics import Metrics

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.settings = Settings(
            cache_dir=cache_dir, host="127.0.0.1", port=self.port, admin_token=ADMIN_TOKEN, **settings
        )
        self.metrics = Metrics()
        self.app = None
        self._server = None
        self._thread = None

    @property
    def engine(self):
        return self.app.state.engine

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value

    def start(self, ready_timeout_s: float = 120.0) -> InProcessServer:
        import threading

        import uvicorn
        from graphcache.api.server.app import create_app

        self.app = create_app(self.settings, metrics=self.metrics)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=self.settings.http.drain_timeout_s,
        )
        self._server = uvicorn.Server(config)
        # Not the main thread: uvicorn installs no signal handlers, pytest keeps its own.
        self._thread = threading.Thread(target=self._server.run, name="uvicorn-test", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("in-process server stopped before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/ready", timeout=2.0).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"in-process server not ready within {ready_timeout_s}s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), "in-process server did not stop"
