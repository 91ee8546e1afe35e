"""Shared helpers for API tests: a served app with a client, and an engine that must not be reached."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics

# A small served engine on the CPU, the settings the API test modules start from.
SMALL_SERVER: dict[str, Any] = {
    "device": "cpu",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 128,
    "warmup_decode_sizes": [],
    "capture_sizes": [1, 2, 4, 8, 16],
}


class EngineNotNeeded:
    """Stands in for the engine where validation, routing or an auth gate must answer first: any
    attribute beyond the few the app reads at startup fails the test."""

    alive = ready = True
    model_name = "test"
    max_model_len = 64
    metrics = None
    generation_defaults: dict = {}  # read by GET /v1/models, never written
    lora_modules = None  # read by GET /v1/models and the model check: no adapters

    def __getattr__(self, name):
        raise AssertionError(f"the engine was reached ({name}) for a request that should be refused")


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, engine: Engine | None = None, *, wait: bool = True, client_addr: str = "127.0.0.1"
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app with its lifespan entered (the engine started, and ready unless wait=False), and an
    httpx client on it through ASGI (client_addr: the peer address the app sees)."""
    app = create_app(settings, engine=engine or Engine(settings, Metrics()))
    async with app.router.lifespan_context(app):
        if wait:
            assert await asyncio.to_thread(app.state.engine.wait_ready, 120), app.state.engine.error
        transport = httpx.ASGITransport(app=app, client=(client_addr, 4321))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as client:
            yield client, app
