"""Client input that must be a 400 naming the field, never a 500 (issue 22, finding 4), the bound on
input echoed in messages, the one-line log of a server fault, the blank API key, and the worker
pools that keep tokenizing from waiting behind other work (finding 5).

The served-process halves (event-loop stalls, HTTP head limits) are in
tests/reliability/test_http_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from graphcache import cli
from graphcache.api.openai.json_limits import MAX_JSON_DEPTH
from graphcache.api.openai.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls
from graphcache.api.server.errors import ECHO_CHARS, MAX_MESSAGE_CHARS, APIError, clip
from graphcache.api.server.request_log import RequestContextMiddleware
from helpers_api import serving
from helpers_model import cpu_settings, tiny_checkpoint

in_module_loop = pytest.mark.asyncio(loop_scope="module")
USER = {"role": "user", "content": "hi"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    settings = cpu_settings(tiny_checkpoint("qwen2"), max_model_len=1024)
    async with serving(settings) as (client, app):
        yield client, app


def _raw(body: dict) -> bytes:
    """JSON text as a client could send it (lone surrogates as \\ud800 escapes; deep nesting allowed)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        return json.dumps(body).encode()
    finally:
        sys.setrecursionlimit(limit)


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    return await client.post(path, content=_raw(body), headers={"content-type": "application/json"})


def _error(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _call(name, arguments) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
        ],
    }


# --------------------------------------------------------------------------- 400s, not 500s


@in_module_loop
@pytest.mark.parametrize("ids", [[1, -1], [2**64], [1, 10**6]])
async def test_echo_of_ids_outside_the_vocabulary_is_a_400(served, ids):
    client, _ = served
    err = _error(
        await _post(client, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1}), "prompt"
    )
    assert "vocabulary" in err["message"] and str(ids[-1]) not in err["message"]


@in_module_loop
async def test_batched_id_prompt_names_its_index(served):
    client, _ = served
    _error(
        await _post(client, "/v1/completions", {"prompt": [[1, 2], [3, -5]], "echo": True, "max_tokens": 1}),
        "prompt[1]",
    )


@in_module_loop
@pytest.mark.parametrize(
    "message",
    [
        _call(5, "{}"),  # a non-string name
        _call(None, "{}"),
        _call("\ud800", "{}"),  # lone surrogates in the name ...
        _call("f", '{"x": "\ud800"}'),  # ... inside the arguments' JSON text
        _call("f", '{"x": "\\ud800"}'),  # ... as an escape inside that text
        _call("f", {"x": "\udfff"}),  # ... or in an arguments object
        _call("f", _nested(500)),  # nested deep, as an object (the body parser's own
        #                                              limit, ~1,000, makes deeper bodies a plain 400) ...
        _call("f", json.dumps(_nested(90))),  # ... or as JSON text past the limit
        _call("f", "[" * 3000 + "]" * 3000),  # ... or as text too deep for json.loads itself
        _call("f", "not json"),
    ],
)
async def test_bad_history_tool_calls_are_a_400_on_that_message(served, message):
    client, _ = served
    _error(
        await _post(client, "/v1/chat/completions", {"messages": [USER, message], "max_tokens": 1}),
        "messages[1].tool_calls",
    )


@in_module_loop
@pytest.mark.parametrize(
    "function",
    [
        {"name": "f", "description": "\ud800"},
        {"name": "f", "parameters": {"type": "object", "properties": {"\udc00": {"type": "string"}}}},
        {"name": "f", "parameters": _nested(500)},
    ],
)
async def test_bad_tools_are_a_400_on_tools(served, function):
    client, _ = served
    body = {"messages": [USER], "tools": [{"type": "function", "function": function}], "max_tokens": 1}
    _error(await _post(client, "/v1/chat/completions", body), "tools")


@in_module_loop
async def test_a_message_name_with_a_lone_surrogate_is_a_400(served):
    client, _ = served
    _error(
        await _post(
            client, "/v1/chat/completions", {"messages": [{**USER, "name": "\ud800"}], "max_tokens": 1}
        ),
        "messages[0].name",
    )


@in_module_loop
async def test_history_calls_within_the_limits_still_render(served):
    client, _ = served
    messages = [
        USER,
        _call("f", json.dumps(_nested(MAX_JSON_DEPTH - 2))),
        _call("g", {"x": [1, {"y": "z"}]}),
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    response = await _post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_model_output_nested_past_the_recursion_limit_is_content_not_a_crash():
    """A model under an endlessly recursive schema writes arrays ~1,500 deep: not a call, just text."""
    text = (
        TOOL_CALL_START
        + '\n{"name": "f", "arguments": {"x": '
        + "[" * 1500
        + "]" * 1500
        + "}}\n"
        + TOOL_CALL_END
    )
    assert parse_tool_calls(text) == (text, [])
    shallow = TOOL_CALL_START + '\n{"name": "f", "arguments": {"x": [[1]]}}\n' + TOOL_CALL_END
    content, calls = parse_tool_calls(shallow)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": [[1]]}


# --------------------------------------------------------------------------- echoed input is bounded


@in_module_loop
async def test_a_huge_tool_name_comes_back_cut(served):
    client, _ = served
    name = "x" * 200_000
    body = {"messages": [USER], "tools": [{"type": "function", "function": {"name": name}}], "max_tokens": 1}
    err = _error(await _post(client, "/v1/chat/completions", body), "tools")
    assert len(err["message"]) < 300 and "200002 characters" in err["message"]


@in_module_loop
async def test_tool_choice_naming_a_huge_function_comes_back_cut(served):
    client, _ = served
    body = {
        "messages": [USER],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "x" * 100_000}},
        "max_tokens": 1,
    }
    err = _error(await _post(client, "/v1/chat/completions", body), "tool_choice")
    assert len(err["message"]) < 400


def test_clip_cuts_and_escapes():
    assert clip("short") == "short"
    long = clip("y" * 10_000)
    assert long.startswith("y" * ECHO_CHARS) and "(10000 characters)" in long and len(long) < ECHO_CHARS + 40
    assert clip("\ud800").encode("utf-8")  # a lone surrogate is escaped, never a UnicodeEncodeError
    assert clip(12345) == "12345"
    assert len(APIError(400, "z" * 100_000).message) < MAX_MESSAGE_CHARS + 40


# --------------------------------------------------------------------------- a server fault: one line each


async def test_a_repeated_server_fault_logs_its_traceback_once(caplog):
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    app.add_middleware(RequestContextMiddleware)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    caplog.set_level(logging.INFO, logger="graphcache.api")
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answers = [await client.get("/boom", headers={"X-Request-ID": f"req-{i}"}) for i in range(3)]
    assert [a.status_code for a in answers] == [500, 500, 500]
    faults = [r for r in caplog.records if r.name == "graphcache.api" and "unhandled error" in r.getMessage()]
    assert len(faults) == 3
    assert [r.exc_info is not None for r in faults] == [True, False, False]
    assert "RuntimeError: kaput" in faults[1].getMessage() and "\n" not in faults[1].getMessage()
    # The request id reaches every record through the handlers' filter (setup_logging): one line each.


# --------------------------------------------------------------------------- a blank API key


def test_serve_with_a_blank_api_key_refuses_to_start(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHCACHE_API_KEY", " , ")
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "api_key" in err[0] and "holds no key" in err[0]


# --------------------------------------------------------------------------- worker pools


@in_module_loop
async def test_tokenizing_does_not_wait_behind_the_shared_pool(served):
    """Every thread of asyncio's shared pool busy (as a burst of large schemas to compile keeps it):
    /tokenize still answers at once, from its own pool."""
    client, _ = served
    loop = asyncio.get_running_loop()
    release = threading.Event()
    blockers = [loop.run_in_executor(None, release.wait, 60)]
    workers = loop._default_executor._max_workers  # noqa: SLF001 (the shared pool's size, made just now)
    blockers += [loop.run_in_executor(None, release.wait, 60) for _ in range(workers + 1)]
    try:
        response = await asyncio.wait_for(client.post("/tokenize", json={"prompt": "hello there"}), 20)
        assert response.status_code == 200 and response.json()["count"] > 0
    finally:
        release.set()
        await asyncio.gather(*blockers)
