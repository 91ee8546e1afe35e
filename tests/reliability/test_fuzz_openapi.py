"""Schemathesis over the server's own OpenAPI schema (/openapi.json): every operation, with valid
input (positive) and, where the operation takes any, invalid input (negative), ~30 examples each.
Whatever it sends: no 5xx, and every 4xx is an OpenAI-shaped JSON error that leaks nothing.

Against the real server process over loopback, not in-process ASGI: schemathesis' pytest plugin
stops an ASGI app's lifespan after each test item, and this app's lifespan owns the engine thread
(a second start is refused). Loopback costs ~1 ms a request, and the real uvicorn is what runs."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.metrics import Metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from .support import ADMIN_TOKEN, LEAK_MARKERS

MAX_EXAMPLES = int(os.environ.get("RELIABILITY_FUZZ_EXAMPLES", "30"))


@pytest.fixture(scope="module")
def server_settings():
    # A short context keeps fuzzed generations (chat defaults to the rest of the window) to a few ms.
    return {
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "warmup_decode_sizes": [1, 2, 4],
    }


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
    return [
        (method.upper(), path, _breakable(op))
        for path, item in spec["paths"].items()
        for method, op in item.items()
        if method in methods
    ]


def _breakable(op: dict) -> bool:
    """Whether an invalid input exists: a body, or a parameter with a constraint. A bare string path
    parameter (/v1/models/{model_id}) accepts every string, so no negative example can be made."""

    def constrained(param: dict) -> bool:
        schema = param.get("schema", {})
        return (
            param.get("in") != "path"
            or schema.get("type") != "string"
            or bool(set(schema) - {"type", "title"})
        )

    return bool(op.get("requestBody")) or any(constrained(p) for p in op.get("parameters", []))


OPERATIONS = _operations()
# Negative examples need something to break: operations without a body or parameters have none.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p, _ in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p, takes_input in OPERATIONS if takes_input
]

# Known bugs the fuzzer finds, as (method, path, mode) -> reason. Their cases run last: the bug can kill
# the engine, which must not fail the other operations' cases.
KNOWN_BUGS: dict[
    tuple[str, str, GenerationMode], str
] = {}  # none now (top_p=5e-324 -> 500: fixed in cc43034)
CASES.sort(key=lambda case: case in KNOWN_BUGS)
PARAMS = [
    pytest.param(
        *case,
        id=f"{case[0]} {case[1]} {case[2].value}",
        marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case])] if case in KNOWN_BUGS else [],
    )
    for case in CASES
]


def clean_error_body(ctx, response, case) -> None:
    """4xx/5xx: {"error": {message, type, param, code}} and nothing internal in it."""
    text = response.content.decode("utf-8", errors="replace") if response.content else ""
    for marker in LEAK_MARKERS:
        assert marker not in text, (
            f"{case.operation.label} {response.status_code} leaks {marker!r}: {text[:300]}"
        )
    if response.status_code < 400:
        return
    body = json.loads(text)
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def test_the_schema_covers_the_api():
    paths = {path for _, path, _ in OPERATIONS}
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/admin/warmup",
        "/admin/clear",
        "/admin/cache",
        "/health",
        "/ready",
    } <= paths, paths


# --- valid input, fuzzed: the generation path itself (sampler, stop strings, detokenizer) ------------


def valid_completion_bodies():
    """Every field within its documented range, so each example must be served (200), however odd."""
    # Cs: lone surrogates are invalid (their own test). At most 8 characters: even at 4 bytes each, byte-level
    # tokens + BOS + max_tokens stay within the server's max_model_len of 64.
    text = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=8)
    return st.fixed_dictionaries(
        {
            "prompt": st.one_of(text, st.lists(st.integers(0, 1023), min_size=1, max_size=20)),
            "max_tokens": st.integers(1, 24),
        },
        optional={
            "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
            "top_p": st.floats(0.0, 1.0, exclude_min=True),
            "top_k": st.one_of(st.just(-1), st.integers(0, 5000)),
            "seed": st.integers(0, 2**63 - 1),
            "stop": st.one_of(st.none(), text, st.lists(text, max_size=4)),
            "ignore_eos": st.booleans(),
            "stream": st.booleans(),
            "user": text,
        },
    )


@pytest.mark.timeout(240)
def test_valid_sampling_parameters_always_complete(server):
    errors_before = server.metrics().value("graphcache_requests_finished_total", reason="error")
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:

        @given(body=valid_completion_bodies())
        @settings(
            max_examples=MAX_EXAMPLES * 2,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(body):
            if body.get("stream"):
                body["stream_options"] = {"include_usage": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, (body, response.text[:300])
            if body.get("stream"):
                events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
                assert events[-1] == "[DONE]", (body, response.text[-300:])
                chunks = [json.loads(e) for e in events[:-1]]
                assert not any("error" in c for c in chunks), (body, chunks)
                usage = next(c["usage"] for c in chunks if c.get("usage"))
                finish = [
                    ch["finish_reason"]
                    for c in chunks
                    for ch in c.get("choices", [])
                    if ch.get("finish_reason")
                ]
            else:
                payload = response.json()
                usage, finish = payload["usage"], [payload["choices"][0]["finish_reason"]]
            assert finish in (["length"], ["stop"]), (body, finish)
            assert 0 <= usage["completion_tokens"] <= body["max_tokens"], (body, usage)
            if finish == ["length"]:
                assert usage["completion_tokens"] == body["max_tokens"], (body, usage)

        fuzz()
    assert server.wait_idle().value("graphcache_requests_finished_total", reason="error") == errors_before


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("method", "path", "mode"), PARAMS)
def test_fuzzed_requests_never_5xx_and_errors_are_clean(api_schema, server, method, path, mode):
    operation = api_schema[path][method]
    served_model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]

    # Derandomized: CI sees the same examples every run (a failure is reproducible, never flaky);
    # set RELIABILITY_FUZZ_EXAMPLES high and run locally for a deeper search.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            # The schema cannot say which model id exists; a random one is a 400 that would hide
            # every other field of the example from the generation path.
            case.body["model"] = served_model
        # With the admin token, so admin bodies are fuzzed past the gate (the gate has its own tests).
        response = case.call(headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        case.validate_response(response, checks=[not_a_server_error, clean_error_body])

    fuzz()
