"""GRAPHCACHE_API_KEY (api/server/auth.py): with keys set, /v1/*, /tokenize and /detokenize want
`Authorization: Bearer <key>` (any one of the keys) and answer 401 in OpenAI's shape otherwise;
probes, /metrics, /ping and /version stay open; /admin/* keeps its own token. Without keys the API is
open. Settings parsing (env, flag, JSON list, ASCII rule) and the official openai client too.

The gate answers before the engine is reached, so most tests run on an engine stand-in; one module
app runs the real Engine with the embedded tiny model for requests that must go through.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import httpx
import openai
import pytest
import pytest_asyncio
from graphcache.api.server import auth
from graphcache.api.server.app import create_app
from graphcache.cli import build_parser, main, settings_from_args
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine, EngineState
from graphcache.metrics import Metrics
from helpers_api import EngineNotNeeded
from pydantic import ValidationError

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = ["key-one-0123456789abcdef", "key-two-fedcba9876543210"]
ADMIN_TOKEN = "admin-token-not-an-api-key"
SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
    "warmup_decode_sizes": [1],
    "capture_sizes": [1, 2, 4, 8, 16],
}

GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/graphcache-tiny", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5]}),
]
OPEN = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
]


class ReadyStandIn(EngineNotNeeded):
    """Answers what probes, /metrics and /v1/models read; anything more fails the test."""

    state = EngineState.READY
    progress = None


@contextlib.asynccontextmanager
async def stand_in(**settings):
    app = create_app(Settings(**settings), engine=ReadyStandIn(), metrics=Metrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c, app


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def openai_client(app, api_key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0
    )


def assert_401(resp: httpx.Response) -> dict:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert err == {
        "message": err["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert all(k not in resp.text for k in KEYS), "a key leaked into the error"
    return err


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "env, keys",
    [
        ("solo-key", ["solo-key"]),
        ("k1,k2", ["k1", "k2"]),
        (" k1 , k2 ,, ", ["k1", "k2"]),
        ("123456", ["123456"]),
    ],
)
async def test_env_holds_one_key_or_several(monkeypatch, env, keys):
    monkeypatch.setenv("GRAPHCACHE_API_KEY", env)
    assert Settings().http.api_key == keys


@pytest.mark.parametrize("env", ["", "  ", ",", " , ,"])
async def test_a_set_but_blank_key_refuses_to_start(monkeypatch, env):
    """A key variable that is set but holds no key would leave the API open without a word: refused,
    with a message naming both fixes."""
    monkeypatch.setenv("GRAPHCACHE_API_KEY", env)
    with pytest.raises(ValidationError) as info:
        Settings()
    text = str(info.value)
    assert "holds no key" in text and "unset GRAPHCACHE_API_KEY" in text and "openssl rand" in text


async def test_settings_take_a_list_a_string_or_none():
    assert Settings().http.api_key is None
    assert Settings(api_key=None).http.api_key is None
    assert Settings(api_key=KEYS).http.api_key == KEYS
    assert Settings(api_key="a,b").http.api_key == ["a", "b"]


@pytest.mark.parametrize("bad", ["caf\u00e9-key", "tab\tkey", "ok,n\u00f6t-ascii", ["fine", "\u00fcber"]])
async def test_non_ascii_keys_are_refused_without_echo(bad):
    with pytest.raises(ValidationError) as info:
        Settings(api_key=bad)
    text = str(info.value)
    assert "api_key" in text and "ASCII" in text
    assert "caf\u00e9" not in text and "n\u00f6t" not in text and "\u00fcber" not in text


@pytest.mark.parametrize("env", ["true", "1.5", "null"])
async def test_env_text_is_a_key_as_written_never_json(monkeypatch, env):
    monkeypatch.setenv("GRAPHCACHE_API_KEY", env)  # "null" must not mean "no key": the API would be open
    assert Settings().http.api_key == [env]


async def test_cli_flag_is_comma_separated_and_secret(capsys):
    args = build_parser().parse_args(["serve", "--api-key", "k1,k2"])
    assert settings_from_args(args).http.api_key == ["k1", "k2"]
    assert main(["serve", "--api-key", "caf\u00e9"]) == 2
    err = capsys.readouterr().err
    assert "api_key" in err and "caf\u00e9" not in err


# --------------------------------------------------------------------------- the gate


async def test_no_key_configured_the_api_is_open():
    async with stand_in() as (client, _):
        r = await client.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "test"
        assert (await client.get("/v1/models/test")).status_code == 200


@pytest.mark.parametrize("method, path, body", GUARDED, ids=[f"{m} {p}" for m, p, _ in GUARDED])
async def test_guarded_routes_want_a_key(method, path, body):
    async with stand_in(api_key=KEYS) as (client, _):
        err = assert_401(await client.request(method, path, json=body))
        assert "GRAPHCACHE_API_KEY" in err["message"]
        for headers in (
            bearer("wrong-key"),
            bearer(KEYS[0][:-1]),
            bearer(KEYS[0] + "x"),
            bearer(KEYS[0].upper()),
            bearer(f"{KEYS[0]},{KEYS[1]}"),
            {"Authorization": f"Basic {KEYS[0]}"},
            {"Authorization": KEYS[0]},
            {"Authorization": "Bearer "},
            {"X-API-Key": KEYS[0]},
        ):
            assert_401(await client.request(method, path, json=body, headers=headers))


async def test_any_configured_key_opens_the_api():
    async with stand_in(api_key=KEYS) as (client, _):
        for key in KEYS:
            for headers in (
                bearer(key),
                {"Authorization": f"bearer {key}"},
                {"Authorization": f"Bearer  {key} "},
            ):
                r = await client.get("/v1/models", headers=headers)
                assert r.status_code == 200, r.text
            assert (await client.get("/v1/models/test", headers=bearer(key))).json()["id"] == "test"


async def test_the_key_is_checked_before_the_body():
    """An unauthenticated client learns nothing from validation: a wrong body without a key is a 401."""
    async with stand_in(api_key=KEYS) as (client, _):
        assert_401(await client.post("/v1/completions", json={"prompt": "x", "temperature": 9}))
        assert_401(await client.post("/tokenize", json={"prompt": 5, "messages": "no"}))
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "temperature": 9}, headers=bearer(KEYS[1])
        )
        assert r.status_code == 400


@pytest.mark.parametrize("method, path", OPEN, ids=[f"{m} {p}" for m, p in OPEN])
async def test_probes_metrics_ping_version_stay_open(method, path):
    async with stand_in(api_key=KEYS) as (client, _):
        r = await client.request(method, path)
        assert r.status_code == 200, r.text


async def test_admin_keeps_its_own_token():
    async with stand_in(api_key=KEYS, admin_token=ADMIN_TOKEN) as (client, _):
        r = await client.get("/admin/cache", headers=bearer(KEYS[0]))
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_token", (
            "an API key is no admin token"
        )
        assert_401(await client.get("/v1/models", headers=bearer(ADMIN_TOKEN)))


async def test_unknown_routes_are_still_404():
    async with stand_in(api_key=KEYS) as (client, _):
        assert (await client.get("/nope")).status_code == 404


async def test_refusals_by_the_gate_are_not_counted_as_rejected_requests():
    async with stand_in(api_key=KEYS) as (client, app):
        await client.post("/v1/completions", json={"prompt": "x"})
        rejected = app.state.metrics.requests_rejected
        assert all(s.value == 0 for m in rejected.collect() for s in m.samples if s.name.endswith("_total"))


async def test_every_key_is_compared(monkeypatch):
    """No early exit: a match on the first key costs as many comparisons as no match at all."""
    calls = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = ["first", "second", "third"]
    assert auth.key_matches(b"first", keys)
    assert len(calls) == 3
    assert {len(a) for pair in calls for a in pair} == {32}, "digests: key lengths do not show"
    calls.clear()
    assert not auth.key_matches(b"fourth", keys) and len(calls) == 3
    assert auth.key_matches(b"third", keys) and not auth.key_matches(b"thir", keys)


# --------------------------------------------------------------------------- the openai client, real engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    settings = Settings(cache_dir=tmp_path_factory.mktemp("graphcache-cache"), api_key=KEYS, **SMALL)
    app = create_app(settings, engine=Engine(settings, Metrics()))
    async with app.router.lifespan_context(app):
        assert await asyncio.to_thread(app.state.engine.wait_ready, 120), app.state.engine.error
        yield app


async def test_openai_client_with_a_key_works(served):
    async with openai_client(served, KEYS[1]) as oai:
        name = served.state.engine.model_name
        assert [m.id for m in (await oai.models.list()).data] == [name]
        assert (await oai.models.retrieve(name)).id == name
        chat = await oai.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        assert chat.usage.completion_tokens >= 1
        stream = await oai.completions.create(model=name, prompt="Once", max_tokens=2, stream=True)
        assert [c async for c in stream], "a stream behind the key"


async def test_openai_client_without_the_right_key_gets_authentication_error(served):
    async with openai_client(served, "not-a-key") as oai:
        with pytest.raises(openai.AuthenticationError) as info:
            await oai.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await oai.chat.completions.create(
                model="graphcache-tiny", messages=[{"role": "user", "content": "x"}]
            )


async def test_real_server_tokenize_needs_the_key_and_probes_do_not(served):
    transport = httpx.ASGITransport(app=served)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        assert_401(await client.post("/tokenize", json={"prompt": "x"}))
        r = await client.post("/tokenize", json={"prompt": "x"}, headers=bearer(KEYS[0]))
        assert r.status_code == 200 and r.json()["count"] >= 1
        for method, path in OPEN:
            assert (await client.request(method, path)).status_code == 200, path
