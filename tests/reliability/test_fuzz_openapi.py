"""Schemathesis over the server's own OpenAPI schema (/openapi.json): every operation, with valid
input (positive) and, where the operation takes any, invalid input (negative), ~30 examples each.
Whatever it sends: no 5xx, and every 4xx is an OpenAI-shaped JSON error that leaks nothing.

Against the real server process over loopback, not in-process ASGI: schemathesis' pytest plugin
stops an ASGI app's lifespan after each test item, and this app's lifespan owns the engine thread
(a second start is refused). Loopback costs ~1 ms a request, and the real uvicorn is what runs."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from service.api.app import create_app
from service.config import Settings
from service.metrics import Metrics

from .support import ADMIN_TOKEN, LEAK_MARKERS

MAX_EXAMPLES = int(os.environ.get("RELIABILITY_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def server_settings():
    # A short context keeps fuzzed generations (chat defaults to the rest of the window) to a few ms.
    return {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 128, "warmup_decode_sizes": [1, 2, 4]}


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


class _SchemaOnlyEngine:
    """Enough of an engine to build the app and read its OpenAPI document at collection time."""

    alive = ready = True
    model_name = "schema-only"
    max_model_len = 64
    metrics = None


def _operations() -> list[tuple[str, str, bool]]:
    """(method, path, takes input) of every operation, read from the app without starting it."""
    spec = create_app(Settings(), engine=_SchemaOnlyEngine(), metrics=Metrics()).openapi()
    methods = ("get", "post", "put", "patch", "delete")
    return [(method.upper(), path, bool(op.get("requestBody") or op.get("parameters")))
            for path, item in spec["paths"].items() for method, op in item.items() if method in methods]


OPERATIONS = _operations()
# Negative examples need something to break: operations without a body or parameters have none.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p, _ in OPERATIONS] + \
        [(m, p, GenerationMode.NEGATIVE) for m, p, takes_input in OPERATIONS if takes_input]


def clean_error_body(ctx, response, case) -> None:
    """4xx/5xx: {"error": {message, type, param, code}} and nothing internal in it."""
    text = response.content.decode("utf-8", errors="replace") if response.content else ""
    for marker in LEAK_MARKERS:
        assert marker not in text, f"{case.operation.label} {response.status_code} leaks {marker!r}: {text[:300]}"
    if response.status_code < 400:
        return
    body = json.loads(text)
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_the_schema_covers_the_api():
    paths = {path for _, path, _ in OPERATIONS}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/warmup", "/admin/clear",
            "/admin/cache", "/health", "/ready"} <= paths, paths


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_fuzzed_requests_never_5xx_and_errors_are_clean(api_schema, method, path, mode):
    operation = api_schema[path][method]

    # Derandomized: CI sees the same examples every run (a failure is reproducible, never flaky);
    # set RELIABILITY_FUZZ_EXAMPLES high and run locally for a deeper search.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        # With the admin token, so admin bodies are fuzzed past the gate (the gate has its own tests).
        response = case.call(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        case.validate_response(response, checks=[not_a_server_error, clean_error_body])

    fuzz()
