"""Error bodies name what the caller can fix and never echo the caller's input: `param` is the
field path as the caller wrote it (no pydantic union/validator tags), 404/405 do not repeat the
path or method, admin warmup does not repeat descriptor strings. Also: requests cut by the drain
timeout are a 503 `shutting_down` with Retry-After (not a 500), and the admin token is ASCII."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from graphcache.api.server.app import create_app
from graphcache.api.server.errors import _param_of
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics
from helpers_api import EngineNotNeeded
from pydantic import ValidationError

TOKEN = "error-bodies-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def client():
    app = create_app(
        Settings(admin_token=TOKEN, capture_sizes=[1, 2, 4, 8], max_num_seqs=4, max_num_batched_tokens=64),
        engine=EngineNotNeeded(),
        metrics=Metrics(),
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


async def post(client, path: str, body, headers=None) -> httpx.Response:
    # json.dumps, not json=: lone surrogates must reach the server as \ud800 escapes.
    return await client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json", **(headers or {})}
    )


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- param: the field as the caller wrote it -------------------------------------------------------


@pytest.mark.parametrize("prompt", [5, None, {"a": 1}, True, 1.5, "\ud800 lone surrogate"])
async def test_a_bad_prompt_type_names_param_prompt(client, prompt):
    error = error_of(await post(client, "/v1/completions", {"prompt": prompt}), 400)
    assert error["param"] == "prompt", error
    assert error["message"].startswith("prompt: "), error
    assert "function-after" not in error["message"] and "[" not in error["param"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1.5, 2]}, "prompt[0]"),  # token ids: the bad one, by index
        ({"prompt": [[1], [2, "x"]]}, "prompt[1][1]"),
        ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop[1]"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "seed": "1"}, "seed"),
    ],
)
async def test_union_fields_name_the_field_and_index_only(client, body, param):
    error = error_of(await post(client, "/v1/completions", body), 400)
    assert error["param"] == param, error
    assert not any(tag in error["message"] for tag in ("function-after", "list[", "union[", "int]")), error


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (5, "messages[0].content"),
        (None, None),  # content may be null: 400 comes from elsewhere
        ([{"type": "image_url"}], "messages[0].content[0].type"),
        ([{"type": "text"}], "messages[0].content[0].text"),
        ("\ud800", "messages[0].content"),
    ],
)
async def test_chat_content_errors_name_messages_index_content(client, content, param):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 0}
    error = error_of(await post(client, "/v1/chat/completions", body), 400)
    if param is not None:
        assert error["param"] == param, error
    assert error["param"] is None or all(c.isalnum() or c in "._[]" for c in error["param"]), error


def test_param_of_strips_pydantic_tags():
    assert _param_of(("body", "prompt", "function-after[_encodable(), str]")) == "prompt"
    assert _param_of(("body", "prompt", "list[int]", 3)) == "prompt[3]"
    assert (
        _param_of(("body", "messages", 0, "content", "list[TextPart]", 1, "text"))
        == "messages[0].content[1].text"
    )
    assert (
        _param_of(("body", "x", "tagged-union[A,B]", "union[int,str]", "nullable[int]", "int", "str")) == "x"
    )
    assert _param_of(("body",)) is None
    assert _param_of(("query", "max_tokens")) == "max_tokens"


# --- nothing echoed -----------------------------------------------------------------------------------


async def test_404_and_405_do_not_echo_the_path_or_method(client):
    for path in ("/v1/whatever-INJECT", "/INJECT/<script>", "/v1/completions/INJECT%0Aline"):
        response = await client.get(path)
        error = error_of(response, 404)
        assert "INJECT" not in response.text and "script" not in response.text, response.text
        assert error["type"] == "not_found_error"
    response = await client.request("DELETE", "/v1/completions")
    error_of(response, 405)
    assert "DELETE" not in response.text and "/v1/completions" not in response.text, response.text
    assert response.headers.get("allow") == "POST"


@pytest.mark.parametrize(
    "descriptor",
    ["INJECT<evil>", "1:2:3:INJECT", "INJECT:4", "\nINJECT:1", "0:0", "99999999999999999999:1:decode"],
)
async def test_admin_warmup_never_echoes_a_descriptor(client, descriptor):
    response = await post(client, "/admin/warmup", {"descriptors": ["8:4", descriptor]}, ADMIN)
    error = error_of(response, 400)
    assert error["param"] == "descriptors[1]", error
    assert "INJECT" not in response.text and "evil" not in response.text and "9999" not in response.text
    assert "TOKENS:REQS" in error["message"] or "capture sizes" in error["message"], error


async def test_admin_warmup_never_echoes_a_size(client):
    response = await post(client, "/admin/warmup", {"sizes": [1, 31337]}, ADMIN)
    error = error_of(response, 400)
    assert error["param"] == "sizes[1]" and "31337" not in response.text, error


# --- the admin token must be ASCII ------------------------------------------------------------------


@pytest.mark.parametrize("token", ["pässword", "sekrit-tök€n", "sekrit\x01", " sekrit", "sekrit\n"])
def test_a_token_clients_cannot_send_as_configured_is_refused_at_start(token):
    with pytest.raises(ValidationError) as exc_info:
        Settings(admin_token=token)
    text = str(exc_info.value)
    assert "use ASCII characters, e.g. a hex token from `openssl rand -hex 32`" in text, text
    assert "Latin-1" in text
    assert token.strip() not in text  # a refused secret is not printed back


def test_ascii_tokens_are_fine():
    for token in ("0123abcd" * 8, "a-b_c.d~e+f/g=", "with inner space"):
        assert Settings(admin_token=token).http.admin_token == token
    assert Settings(admin_token="").http.admin_token is None


async def test_admin_compares_the_header_bytes_as_received(client):
    """A latin-1 header byte never matches an ASCII token by accident, and the right token still does
    when the header carries trailing whitespace."""
    for raw in (
        f"Bearer {TOKEN}\xe9".encode("latin-1"),
        f"Bearer {TOKEN[:-1]}\xe9".encode("latin-1"),
        f"Bearer {TOKEN[:-1]}é".encode(),
    ):
        error = error_of(
            await client.post("/admin/warmup", json={"sizes": [1]}, headers={"Authorization": raw}), 403
        )
        assert error["code"] == "invalid_token"


# --- requests cut by the drain timeout: 503 shutting_down, not 500 ----------------------------------


@pytest.mark.timeout(180)
async def test_requests_cut_by_the_drain_timeout_are_503_shutting_down(tmp_path):
    settings = Settings(
        cache_dir=tmp_path,
        device="cpu",
        max_num_seqs=2,
        max_num_batched_tokens=64,
        warmup_decode_sizes=[],
        capture_sizes=[1, 2, 4],
        drain_timeout_s=0.5,
    )
    metrics = Metrics()
    app = create_app(settings, engine=Engine(settings, metrics), metrics=metrics)
    body = {"prompt": "never finishes", "max_tokens": 1500, "ignore_eos": True}
    async with app.router.lifespan_context(app):
        engine = app.state.engine
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.error
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60
        ) as client:
            plain = asyncio.create_task(client.post("/v1/completions", json=body))
            streamed = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": True}))
            for _ in range(600):  # both running
                if engine.stats()["in_flight"] == 2:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await asyncio.wait_for(app.state.drain(), 30)  # 0.5 s, then the engine fails both
            response, stream = await asyncio.wait_for(asyncio.gather(plain, streamed), 30)

    error = error_of(response, 503)
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable", error
    assert int(response.headers["retry-after"]) >= 1
    assert "drain" in error["message"] and "retry" in error["message"]

    assert stream.status_code == 200
    frames = [f[6:] for f in stream.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]", frames[-3:]
    event = json.loads(frames[-2])
    assert event["error"]["code"] == "shutting_down", event
    # Cut requests are not refusals: requests_rejected{draining} counts only those refused at the door.
    assert metrics.registry.get_sample_value(
        "graphcache_requests_rejected_total", {"reason": "draining"}
    ) in (None, 0)


# --------------------------------------------------------------------------- cross-field rules name their field


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ("/tokenize", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
)
async def test_a_cross_field_400_names_its_param(path, body, param):
    app = create_app(Settings(), engine=EngineNotNeeded(), metrics=Metrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert not error["message"].startswith(f"{param}: {param}")
