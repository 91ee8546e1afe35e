"""Shared helpers for API tests: a served app with a client, and an engine that must not be reached."""

from __future__ import annotations

import asyncio
import contextlib
import json
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


async def drive_then_disconnect(app, body: dict, after: str, path: str = "/v1/completions") -> list[dict]:
    """POST `body` to `path` over raw ASGI and hang up `after`: "http.response.start" (the headers),
    "http.response.body" (the first body chunk) or "in_flight" (once the engine works on it, before any
    answer byte). Returns the messages sent. httpx's ASGITransport cannot disconnect mid-stream."""
    payload = json.dumps(body).encode()
    sent: list[dict] = []
    got_chunk = asyncio.Event()
    request_done = False

    async def receive():
        nonlocal request_done
        if not request_done:
            request_done = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if after == "in_flight":  # leave once the engine works on it, before any answer byte
            while not app.state.engine.stats()["in_flight"]:
                await asyncio.sleep(0.005)
        else:
            await got_chunk.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == after and (after == "http.response.start" or message.get("body")):
            got_chunk.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": b"",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
        "state": {},
    }
    await asyncio.wait_for(app(scope, receive, send), 60)
    return sent
