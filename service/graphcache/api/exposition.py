"""GET /metrics: the Prometheus text exposition of the server's `Metrics` registry.

The registry holds graphcache's series, vLLM's `vllm:` names for the same engine (vllm_metrics.py),
the process collectors and the HTTP series of prometheus-fastapi-instrumentator (app.py). Open like
the probes: scrapers carry no API key, and nothing here names a request or a prompt.

The engine and the graph cache record into the registry as things happen (from the engine
thread); only values that are cheaper to read than to track (ready) are set here, at scrape time.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["router"]

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    state = request.app.state
    m = state.metrics
    m.ready.set(1 if state.engine.ready else 0)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
