"""The FastAPI app: factory, lifespan, middleware, health probes.

`create_app(settings)` builds an Engine (unless one is given) and starts it in the
lifespan without waiting: the engine loads and warms up on its own thread while the port
is already bound, so /health answers at once and /ready says 503 until the model is
served. On shutdown: stop taking requests, let in-flight ones drain within
drain_timeout_s, then stop the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphcache import __version__
from graphcache.api.openai import embeddings, invocations, routes, tools
from graphcache.api.openai.prompt_encoding import render_pools
from graphcache.api.openai.responses import route as responses_route
from graphcache.api.server import admin, exposition, lora_admin
from graphcache.api.server.errors import count_rejection, error_body, install_error_handlers
from graphcache.api.server.request_log import PROBE_PATHS, RequestContextMiddleware, setup_logging
from graphcache.config import Settings
from graphcache.engine.errors import DEAD_MESSAGE  # probes: never the exception text
from graphcache.engine.loop.frontend import EngineState
from graphcache.engine.loop.process import EngineClient
from graphcache.metrics import Metrics

__all__ = ["create_app"]

# Paths kept out of the HTTP metrics: scrapes and probes would drown the traffic (vLLM leaves out the same).
UNMEASURED_PATHS = sorted(PROBE_PATHS)

log = logging.getLogger("graphcache.api")


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`, whether announced by Content-Length or streamed chunked.

    Raising Starlette's HTTPException from receive() makes FastAPI pass it through its body
    parser to the error handlers, so the 413 has the OpenAI error shape.
    """

    def __init__(self, app, max_bytes: int, on_reject=None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # (path, method) -> None: counts refusals answered here, before any handler
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if self.on_reject is not None:
                self.on_reject(scope["path"], scope.get("method", ""))
            body = json.dumps(
                error_body(self._message(), "invalid_request_error", code="request_too_large")
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return (
            f"The request body is larger than {self.max_bytes} bytes; send less or raise "
            "GRAPHCACHE_MAX_BODY_BYTES (--max-body-bytes)."
        )


def in_process_engine(settings: Settings, metrics: Metrics):
    """The engine on a thread of this process. Imported here, not at the top: with engine_process the API
    process loads neither torch nor the model code (tests/test_floors.py checks it)."""
    from graphcache.engine.loop.engine import Engine

    return Engine(settings, metrics)


def create_app(settings: Settings, engine=None, metrics: Metrics | None = None) -> FastAPI:
    metrics = metrics if metrics is not None else (getattr(engine, "metrics", None) or Metrics())
    # engine_process: the step loop in a child process, same interface (engine/loop/process.py)
    if engine is None:
        engine = (
            EngineClient(settings, metrics, setup_logging=setup_logging)
            if settings.engine.engine_process
            else in_process_engine(settings, metrics)
        )
    if getattr(engine, "model_name", None):  # the vllm: series' model_name label; set before any traffic
        metrics.bind_model(engine.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()  # returns at once; loading and warmup run on the engine thread
        pools = render_pools(app)
        # A chat-template worker starts while the model loads, so the first chat does not wait for it.
        warming = asyncio.create_task(pools["model"].warm())
        log.info(
            "serving on %s:%s; engine loading (GET /ready turns 200 when it is done)",
            settings.http.host,
            settings.http.port,
        )
        try:
            yield
        finally:
            # `graphcache serve` drained already (on SIGTERM, while uvicorn waited for open
            # connections); an embedding app that did not gets the same drain here.
            await drain()
            warming.cancel()
            for pool in pools.values():
                await pool.close()
            await asyncio.to_thread(engine.shutdown)
            log.info("engine stopped")

    async def drain() -> None:
        """Refuse new requests (503), give in-flight ones drain_timeout_s, then end the rest with a
        clean error (the engine finishes them with finish_reason "error"; handlers answer)."""
        report = await engine.drain(settings.http.drain_timeout_s)  # stops the engine accepting first
        if report.get("in_flight"):
            log.info("drained: %s", report)

    app = FastAPI(
        title="graphcache",
        version=__version__,
        lifespan=lifespan,
        description="OpenAI-compatible LLM server with a managed CUDA-graph cache.",
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.started = int(time.time())

    install_error_handlers(app, metrics)
    app.include_router(routes.router)  # /v1/*: behind the API key when one is set (auth.py)
    app.include_router(responses_route.router)  # /v1/responses: behind it too
    app.include_router(embeddings.router)  # /v1/embeddings: behind it too
    app.include_router(invocations.router)  # /invocations: by the body's shape, behind the key too
    app.include_router(tools.guarded)  # /tokenize, /detokenize, /v1/models/{id}: behind it too
    app.include_router(tools.router)  # /version, /ping: open, like the probes
    app.include_router(admin.router)
    app.include_router(lora_admin.router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter: admin token
    app.include_router(exposition.router)

    @app.get("/health", tags=["probes"])
    async def health() -> JSONResponse:
        """Liveness: 200 unless the engine thread died (then 503). Unauthenticated, so the body says
        only that it died; the cause is in the server log and on /admin/*."""
        if not engine.alive:
            return JSONResponse({"status": "dead", "error": DEAD_MESSAGE}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", tags=["probes"])
    async def ready() -> JSONResponse:
        """Readiness: 200 once the model is loaded and warmup is done; 503 while loading or draining."""
        state = engine.state
        if state is EngineState.READY:
            return JSONResponse({"status": "ready", "model": engine.model_name})
        if state is EngineState.DEAD:
            return JSONResponse({"status": "dead", "error": DEAD_MESSAGE}, status_code=503)
        if state is EngineState.LOADING:
            body = {"status": "loading"}
            if engine.progress is not None:
                body["progress"] = engine.progress
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "draining"}, status_code=503)  # draining, or stopped

    # Outermost first: request ids wrap everything (so the 413 and 500 carry one), CORS only on request.
    def count_oversized(path: str, method: str) -> None:
        count_rejection(metrics, path, method, 413)

    app.add_middleware(
        BodySizeLimitMiddleware, max_bytes=settings.http.max_body_bytes, on_reject=count_oversized
    )
    if settings.http.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.http.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
        )
    app.add_middleware(RequestContextMiddleware)
    # HTTP series (http_requests_total, http_request_duration_seconds, ...) as vLLM exposes them, on the
    # server's registry: exposition.py serves them on /metrics; the instrumentator's own endpoint is not used.
    Instrumentator(excluded_handlers=UNMEASURED_PATHS, registry=metrics.registry).instrument(app)
    return app
