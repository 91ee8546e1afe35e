"""GET /metrics: the Prometheus text exposition of the server's `Metrics` registry.

The registry holds graphcache's series, vLLM's `vllm:` names for the same engine (vllm_metrics.py),
the process collectors and the HTTP series of prometheus-fastapi-instrumentator (app.py). Open like
the probes: scrapers carry no API key, and nothing here names a request or a prompt.

The engine and the graph cache record into the registry as things happen (from the engine
thread); only values that are cheaper to read than to track (ready) are set here, at scrape time.

With the engine in its own process (engine_process, engine/loop/process.py) the engine's series are
recorded there: a scrape asks it for its exposition (one round trip) and serves it merged with this
process's. A family both have (this process's Metrics declares every engine series too, unrecorded)
is taken from the engine process, except API_FAMILIES, which only this process records. The process_*
and python_* series are this process's (the engine process's registry has none). If the engine
process cannot answer (dead, stopping), this process's own exposition is served alone.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from graphcache.engine.loop.process import EngineClient

__all__ = ["API_FAMILIES", "merge_expositions", "router"]

router = APIRouter()
log = logging.getLogger("graphcache.api")

# Families the API process records itself (refusals before admission, readiness as it answers /ready,
# the n of each request: the engine sees each choice as its own sequence).
API_FAMILIES = frozenset({"graphcache_requests_rejected", "graphcache_ready", "vllm:request_params_n"})
# A scrape never waits longer than this for the engine process (a busy step loop answers in milliseconds).
ENGINE_SCRAPE_TIMEOUT_S = 5.0


class _Families:
    """A collector that yields already-parsed families (to render them with generate_latest)."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_expositions(own: str, engine: str) -> bytes:
    """One exposition from this process's text and the engine process's: no family twice."""
    engine_families = {f.name: f for f in text_string_to_metric_families(engine)}
    merged = []
    for family in text_string_to_metric_families(own):
        if family.name in engine_families and family.name not in API_FAMILIES:
            merged.append(engine_families.pop(family.name))
        else:
            engine_families.pop(family.name, None)
            merged.append(family)
    merged.extend(engine_families.values())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merged))
    return generate_latest(registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    state = request.app.state
    m = state.metrics
    m.ready.set(1 if state.engine.ready else 0)
    body = generate_latest(m.registry)
    if isinstance(state.engine, EngineClient):
        try:
            engine_text = await asyncio.wait_for(state.engine.metrics_text(), ENGINE_SCRAPE_TIMEOUT_S)
            body = merge_expositions(body.decode(), engine_text)
        except Exception as exc:  # noqa: BLE001 - a scrape still gets this process's series
            log.debug("engine process metrics unavailable: %s: %s", type(exc).__name__, exc)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
