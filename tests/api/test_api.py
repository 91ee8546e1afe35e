"""ASGI tests of the OpenAI-compatible API, probes, metrics and the HTTP floor's error handling.

They run the real Engine on the embedded tiny model on the CPU (one server for the module:
loading costs a second or two), through httpx's ASGITransport. ASGITransport does not run
the lifespan, so the app's lifespan context is entered explicitly, exactly as uvicorn would.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import pytest_asyncio
import torch
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.loop.engine import DEAD_MESSAGE, Engine, EngineState, SamplingParams
from graphcache.metrics import Metrics
from helpers_api import drive_then_disconnect, serving
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEAKS = ("Traceback", 'File "', ".py", "/work/", "site-packages")
SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [1, 2],
    "capture_sizes": [1, 2, 4, 8, 16],
    "drain_timeout_s": 2.0,
}


def settings_for(tmp_cache, **overrides) -> Settings:
    return Settings(cache_dir=tmp_cache, **{**SMALL, **overrides})


def make_engine(settings: Settings, runner_factory=None) -> Engine:
    """The real Engine, recording into its own registry (create_app exposes engine.metrics)."""
    return Engine(settings, Metrics(), runner_factory=runner_factory)


def running(settings: Settings, engine: Engine | None = None, wait: bool = True):
    """The app with its lifespan entered (engine started), and a client on it."""
    return serving(settings, engine or make_engine(settings), wait=wait)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("graphcache-cache")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(cache_dir):
    async with running(settings_for(cache_dir)) as pair:
        yield pair


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def app(served):
    return served[1]


def assert_error(resp: httpx.Response, status: int, *, param: str | None = "any", code: str | None = "any"):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert not any(marker in err["message"] for marker in LEAKS), err["message"]
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


async def post_json(client: httpx.AsyncClient, path: str, body) -> httpx.Response:
    """json.dumps escapes lone surrogates as \\ud800 (valid JSON) where httpx's json= cannot encode them."""
    return await client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def sse_events(text: str) -> list:
    """`data: <json>\\n\\n` frames -> parsed objects; the final `[DONE]` stays a string."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]


def scrape(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""
            )
            out[key] = s.value
    return out


# --------------------------------------------------------------------------- probes, models, metrics


async def test_health_ready_models(client, app):
    r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = await client.get("/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    r = await client.get("/v1/models")
    data = r.json()["data"]
    assert r.status_code == 200 and len(data) == 1
    assert data[0]["id"] == app.state.engine.model_name and data[0]["object"] == "model"


async def test_metrics_exposition(client):
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = scrape(r.text)
    assert samples["graphcache_ready"] == 1
    assert "graphcache_requests_finished_total{reason=stop}" in samples


async def test_request_id_echoed_or_made(client):
    r = await client.get("/health", headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = await client.get("/health")
    assert len(r.headers["x-request-id"]) == 32
    r = await client.get("/health", headers={"X-Request-ID": "bad id\twith junk"})
    assert r.headers["x-request-id"] != "bad id\twith junk"


# --------------------------------------------------------------------------- completions


async def test_completion_non_streaming(client, app):
    r = await client.post(
        "/v1/completions",
        json={
            "model": app.state.engine.model_name,
            "prompt": "Hello",
            "max_tokens": 5,
            "ignore_eos": True,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


async def test_completion_token_ids_and_seed_are_deterministic(client):
    req = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 1234}
    a = (await client.post("/v1/completions", json=req)).json()
    b = (await client.post("/v1/completions", json=req)).json()
    assert a["usage"]["prompt_tokens"] == 4
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


async def test_completion_streaming_with_usage(client):
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "Hi there",
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in r.headers  # a stream has no length; uvicorn would cut it at 0
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


async def test_stream_without_usage_has_no_usage_chunk(client):
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True, "stream": True}
    )
    events = sse_events(r.text)
    assert all("usage" not in e for e in events[:-1])


# --------------------------------------------------------------------------- chat


async def test_chat_non_streaming(client):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_completion_tokens": 3,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3


async def test_chat_streaming(client):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------- validation -> 400

BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 200}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["one", ""]}, "prompt"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"prompt": "x", "stop": "\udfff"}, "stop"),
    ({"prompt": 5}, None),
    ({"prompt": [1.5, 2]}, None),
    ({"prompt": [10**9]}, None),
    ({"prompt": [3] * 5000}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(
    ("body", "param"), BAD_COMPLETIONS, ids=[json.dumps(b)[:60] for b, _ in BAD_COMPLETIONS]
)
async def test_completion_rejects_bad_input(client, body, param):
    err = assert_error(await post_json(client, "/v1/completions", body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"role": "", "content": "x"}]},
    {"messages": [{"role": "w" * 65, "content": "x"}]},
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
    {"messages": [{"role": "user", "content": "x"}], "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "\ud800"}]},
]


@pytest.mark.parametrize("body", BAD_CHATS, ids=[json.dumps(b)[:60] for b in BAD_CHATS])
async def test_chat_rejects_bad_input(client, body):
    assert_error(await post_json(client, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}),
    ],
)
async def test_unknown_model_is_404(client, path, body):
    err = assert_error(await post_json(client, path, body), 404, param="model", code="model_not_found")
    assert err["type"] == "invalid_request_error"


async def test_unknown_fields_are_ignored(client):
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw", [b"{not json", b"\xff\xfe\x00garbage", b"[" * 100_000 + b"]" * 100_000, b'"just a string"', b""]
)
async def test_malformed_bodies_are_400(client, raw):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)


async def test_body_size_limit_413(client, app):
    def rejected() -> float:
        return app.state.metrics.registry.get_sample_value(
            "graphcache_requests_rejected_total", {"reason": "invalid"}
        )

    before = rejected()
    big = {"prompt": "x" * (app.state.settings.http.max_body_bytes + 10)}
    assert_error(await client.post("/v1/completions", json=big), 413, code="request_too_large")

    async def chunks():  # no Content-Length: the limit must hold on the streamed body too
        for _ in range(20):
            yield b" " * 100_000

    r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413)
    assert rejected() == before + 2


async def test_404_and_405_have_openai_shape(client):
    assert_error(await client.get("/v1/nothing-here"), 404)
    assert_error(await client.get("/v1/completions"), 405)


async def test_rejections_are_counted(client):
    before = scrape((await client.get("/metrics")).text)["graphcache_requests_rejected_total{reason=invalid}"]
    await client.post("/v1/completions", json={"prompt": "x", "temperature": 9})
    after = scrape((await client.get("/metrics")).text)["graphcache_requests_rejected_total{reason=invalid}"]
    assert after == before + 1


async def test_unexpected_error_is_a_bare_500(client, app, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret internal detail /work/main/service/x.py")

    monkeypatch.setattr(app.state.engine.tokenizer, "encode", boom)
    r = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-ID": "req-500"})
    err = assert_error(r, 500)
    assert "secret" not in err["message"] and r.headers["x-request-id"] == "req-500"


# --------------------------------------------------------------------------- overload, draining, disconnect


async def test_queue_full_is_429_with_retry_after(cache_dir):
    settings = settings_for(cache_dir, max_num_seqs=1, max_queue=1, warmup_decode_sizes=[])
    async with running(settings) as (client, app):
        engine = app.state.engine
        params = SamplingParams(max_tokens=engine.max_model_len - 3, ignore_eos=True)
        hogs = [engine.generate("hog-0", [5, 6, 7], params)]
        await anext(hogs[0])  # hog-0 runs now (max_num_seqs=1): the next one has to wait
        hogs.append(engine.generate("hog-1", [5, 6, 7], params))
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = assert_error(r, 429, code="queue_full")
        assert err["type"] == "rate_limit_error" and int(r.headers["retry-after"]) >= 1
        for i, hog in enumerate(hogs):
            engine.abort(f"hog-{i}")
            async for _ in hog:
                pass
        metrics = scrape((await client.get("/metrics")).text)
        assert metrics["graphcache_requests_rejected_total{reason=queue_full}"] >= 1


async def test_draining_is_503(client, app):
    engine = app.state.engine
    engine._set_state(
        EngineState.DRAINING
    )  # what SIGTERM's drain does first; undone below for the next tests
    try:
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert_error(r, 503, code="draining")
        assert (await client.get("/ready")).status_code == 503
        assert (await client.get("/health")).status_code == 200
    finally:
        engine._set_state(EngineState.READY)


@pytest.mark.parametrize(
    ("stream", "leave_after"),
    [
        (True, "http.response.start"),  # right after the headers: the SSE generator never ran
        (True, "http.response.body"),  # after the first chunk
        (False, "in_flight"),  # while the engine generates, before any answer byte
    ],
)
async def test_client_disconnect_aborts_and_frees_blocks(client, app, stream, leave_after):
    engine = app.state.engine
    before = scrape((await client.get("/metrics")).text)["graphcache_requests_finished_total{reason=abort}"]
    body = {"prompt": "tell me a long story", "max_tokens": 100, "ignore_eos": True, "stream": stream}
    sent = await drive_then_disconnect(app, body, leave_after)
    assert sent[0]["status"] == (200 if stream else 499)
    for _ in range(200):  # the abort travels through the engine inbox; blocks are freed between steps
        if not engine.stats()["in_flight"]:
            break
        await asyncio.sleep(0.02)
    assert engine.stats()["in_flight"] == 0
    after = scrape((await client.get("/metrics")).text)["graphcache_requests_finished_total{reason=abort}"]
    assert after == before + 1
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# --------------------------------------------------------------------------- engine states (real Engine)


async def test_loading_then_ready(cache_dir):
    """Probes while the engine loads: /health 200, /ready 503, generation 503 not_ready."""
    from graphcache.engine.worker.runner import ModelRunner

    release = threading.Event()

    def slow_runner(settings, metrics):  # the real runner, held back until the test has probed
        release.wait(30)
        return ModelRunner(settings, metrics)

    settings = settings_for(cache_dir)
    async with running(settings, make_engine(settings, runner_factory=slow_runner), wait=False) as (
        client,
        app,
    ):
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert_error(await client.post("/v1/completions", json={"prompt": "x"}), 503, code="not_ready")
        assert_error(await client.get("/admin/cache"), 403)  # admin is off without a token
        release.set()
        assert await asyncio.to_thread(app.state.engine.wait_ready, 60)
        assert (await client.get("/ready")).status_code == 200


async def test_dead_engine(cache_dir):
    """Probes and request errors say the engine died, never why (the exception text can carry
    paths and device details): that goes to the log and to the authenticated /admin/* only."""

    def broken_runner(settings, metrics):
        raise RuntimeError('weights are corrupt in File "/work/secret/model.py"')

    settings = settings_for(cache_dir, admin_token="t0ken")
    async with running(settings, make_engine(settings, runner_factory=broken_runner), wait=False) as (
        client,
        app,
    ):
        await asyncio.to_thread(app.state.engine.wait_ready, 30)
        assert "weights are corrupt" in app.state.engine.error
        for probe in ("/health", "/ready"):
            r = await client.get(probe)
            assert r.status_code == 503 and r.json() == {"status": "dead", "error": DEAD_MESSAGE}, probe
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert_error(r, 503, code="engine_dead")
        assert "corrupt" not in r.text and "/work/" not in r.text
        r = await client.get("/admin/cache", headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert "weights are corrupt" in r.json()["error"]["message"]  # the operator may see the cause


async def test_engine_death_mid_request_sends_a_fixed_message(cache_dir):
    """Requests in flight when the engine dies get a 500 with the fixed message, not the exception."""
    settings = settings_for(cache_dir)
    engine = make_engine(settings)

    def device_lost(batch):
        raise torch.AcceleratorError(
            'CUDA error: device lost in File "/work/main/service/engine/worker/runner.py", line 1'
        )

    async with running(settings, engine) as (client, app):
        engine.step_failpoint = device_lost
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        err = assert_error(r, 500, code="engine_error")
        assert "/work/" not in r.text and 'File "' not in r.text and "CUDA" not in r.text
        assert err["type"] == "server_error"
        assert not engine.alive and "device lost" in engine.error
        for probe in ("/health", "/ready"):
            r = await client.get(probe)
            assert r.status_code == 503 and "CUDA" not in r.text and "/work/" not in r.text


async def test_cors_off_by_default_and_on_when_configured(client, cache_dir):
    preflight = {"Origin": "https://example.com", "Access-Control-Request-Method": "POST"}
    r = await client.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    settings = settings_for(cache_dir, cors_origins=["https://example.com"])
    app = create_app(settings, engine=make_engine(settings))  # no lifespan needed for a preflight
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c2:
        r = await c2.options("/v1/completions", headers=preflight)
        assert r.headers["access-control-allow-origin"] == "https://example.com"


async def test_chat_default_max_tokens_fits_a_small_kv_cache(cache_dir):
    """No max_tokens in chat = the rest of the window, capped to what the KV cache can hold."""
    settings = settings_for(cache_dir, num_kv_blocks=8, block_size=16, max_num_seqs=1, warmup_decode_sizes=[])
    async with running(settings) as (client, _):
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] <= 8 * 16
