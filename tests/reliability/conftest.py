"""Fixtures of the reliability suite: real `graphcache serve` processes on free loopback ports.

A module gets one server (module scope: startup costs seconds, the tests of one module share it);
it overrides `server_settings` to size the server for its fault (tiny KV cache, tiny queue, ...).
Tests that kill or drain their server start their own with `server_factory`.
Every server is stopped (SIGTERM, then SIGKILL) when its fixture ends, pass or fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .support import ServerProcess


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GRAPHCACHE_CACHE_DIR for the session: the embedded tiny model is written once, on the
    first server's start, and read by the rest (servers start one after another, so no race)."""
    return tmp_path_factory.mktemp("graphcache-cache")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="module")
def server_settings() -> dict[str, Any]:
    """Override in a module to size its server; these keep CPU steps short."""
    return {}


BASE_SETTINGS: dict[str, Any] = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "drain_timeout_s": 10.0,
}


@pytest.fixture(scope="module")
def server(
    cache_dir: Path, log_dir: Path, server_settings: dict[str, Any], request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    name = request.module.__name__.rsplit(".", 1)[-1]
    proc = ServerProcess(cache_dir, log_dir, name=name, **{**BASE_SETTINGS, **server_settings})
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def server_factory(
    cache_dir: Path, log_dir: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., ServerProcess]]:
    """start(**settings) -> a ready server, stopped at the end of the test whatever happened."""
    started: list[ServerProcess] = []

    def start(name: str | None = None, **settings: Any) -> ServerProcess:
        proc = ServerProcess(
            cache_dir, log_dir, name=name or request.node.name, **{**BASE_SETTINGS, **settings}
        )
        started.append(proc)
        return proc.start()

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()
