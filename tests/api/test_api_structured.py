"""Issue 12 items 5 and 6 through the HTTP API: structured output (response_format, guided_*) and tool
calls (tools, tool_choice, tool messages) on a served app, end to end.

The real Engine serves the embedded tiny random-weight model on the CPU (one app for the module). Its
text is noise, so everything checked here is what the grammar guarantees: JSON that validates against
its schema (jsonschema), a choice from the list, a regex match, tool calls parsed into `tool_calls`
with arguments valid for the tool's parameters, streamed or not. The schemas bound every value (enums,
small integer ranges, additionalProperties false) and ask llguidance for compact JSON
(`x-guidance.whitespace_flexible: false`, an annotation JSON Schema validators ignore): a random model
given free whitespace spends its tokens on it.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from graphcache.config import Settings
from graphcache.engine.sample.structured import StructuredOutput
from helpers_api import serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "warmup_decode_sizes": [1],
    "capture_sizes": [1, 2, 4, 8, 16],
}
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
    **COMPACT,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
    **COMPACT,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME_SCHEMA},
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 120  # a compact call or object is ~20 tokens; the grammar's completion ends it far earlier


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as pair:
        yield pair


@pytest.fixture
def client(served) -> httpx.AsyncClient:
    return served[0]


@pytest.fixture
def oai(served) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=served[1]), base_url="http://testserver", timeout=60
    )
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


def sse(text: str) -> list[dict]:
    frames = [f[6:] for f in text.split("\n\n") if f]
    assert frames[-1] == "[DONE]", text[-300:]
    return [json.loads(f) for f in frames[:-1]]


def reassemble(chunks: list[dict]) -> dict[int, dict]:
    """Chat stream chunks -> per choice: content, tool calls (by index: id, name, arguments), finish."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            c = out.setdefault(choice["index"], {"content": "", "calls": {}, "finish": None})
            delta = choice["delta"]
            c["content"] += delta.get("content") or ""
            for entry in delta.get("tool_calls") or []:
                call = c["calls"].get(entry["index"])
                if call is None:  # the first delta of a call announces it whole
                    assert entry["type"] == "function" and entry["id"].startswith("call_"), entry
                    call = c["calls"][entry["index"]] = {
                        "id": entry["id"],
                        "name": entry["function"]["name"],
                        "arguments": "",
                    }
                else:
                    assert "id" not in entry and "name" not in entry["function"], entry
                call["arguments"] += entry["function"].get("arguments", "")
            if choice["finish_reason"] is not None:
                assert c["finish"] is None, "a second finish_reason"
                c["finish"] = choice["finish_reason"]
    return out


def assert_valid_call(name: str, arguments: str, expected_name: str | None = None) -> None:
    assert name in PARAMETERS and (expected_name is None or name == expected_name), name
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def chat(**fields) -> dict:
    return {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "seed": 7, **fields}


def json_schema_format(schema: dict = SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}


# --------------------------------------------------------------------------- structured output


async def test_json_schema_chat_through_the_openai_client(oai):
    for seed in (1, 2):
        resp = await oai.chat.completions.create(
            model="graphcache-tiny",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            seed=seed,
            response_format=json_schema_format(),
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


async def test_json_schema_chat_streamed_through_the_openai_client(oai):
    stream = await oai.chat.completions.create(
        model="graphcache-tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=3,
        response_format=json_schema_format(),
        stream=True,
    )
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_completions(client, stream):
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": "The weather:",
            "max_tokens": MAX_TOKENS,
            "seed": 4,
            "response_format": json_schema_format(),
            "stream": stream,
        },
    )
    assert r.status_code == 200, r.text
    if stream:
        chunks = sse(r.text)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_guided_json_on_chat_with_n_choices(client):
    r = await client.post("/v1/chat/completions", json=chat(guided_json=SCHEMA, n=2))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
async def test_guided_choice_returns_one_of_the_choices(client, stream):
    options = ["sunny", "rainy", "overcast with a chance of meatballs"]
    for path, body in (
        ("/v1/completions", {"prompt": "Tomorrow will be", "max_tokens": 30}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 30}),
    ):
        r = await client.post(path, json={**body, "guided_choice": options, "seed": 5, "stream": stream})
        assert r.status_code == 200, r.text
        choices = [c["choices"][0] for c in sse(r.text)] if stream else r.json()["choices"]
        text = "".join(
            c.get("text") or (c.get("message") or c.get("delta", {})).get("content") or "" for c in choices
        )
        assert text in options and choices[-1]["finish_reason"] == "stop", (path, text)


async def test_guided_regex_matches(client):
    pattern = r"[0-9]{3}-[a-z]{2}"
    for path, body in (
        ("/v1/completions", {"prompt": "Code:", "max_tokens": 30}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 30}),
    ):
        r = await client.post(path, json={**body, "guided_regex": pattern, "seed": 6})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text", None) if "text" in choice else choice["message"]["content"]
        assert re.fullmatch(pattern, text) and choice["finish_reason"] == "stop", text


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
INVALID = [
    ("/v1/completions", {"response_format": json_schema_format(BAD_SCHEMA)}, "response_format"),
    ("/v1/chat/completions", {"response_format": json_schema_format(BAD_SCHEMA)}, "response_format"),
    ("/v1/completions", {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/chat/completions", {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/completions", {"guided_regex": "([a-z"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_regex": "([a-z"}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": "start: ("}, "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    (
        "/v1/chat/completions",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    (
        "/v1/chat/completions",
        {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"},
        "guided_regex",
    ),
]


@pytest.mark.parametrize(("path", "fields", "param"), INVALID, ids=[f"{p[4:]}-{q}" for p, _, q in INVALID])
async def test_an_invalid_constraint_is_a_400_naming_its_field(
    client, served, monkeypatch, path, fields, param
):
    engine = served[1].state.engine
    reached = []
    original = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **kw: reached.append(a) or original(*a, **kw))
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = await client.post(path, json={**base, "max_tokens": 5, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert not reached, "an invalid constraint reached the engine"


async def test_constraints_compile_off_the_event_loop(client, monkeypatch):
    """The first compile of a spec (the slow one) runs in a worker thread, not on the event loop."""
    calls: list[tuple[str, bool]] = []
    original = StructuredOutput.check

    def recording(self, spec, param=None):
        calls.append((spec.value, threading.current_thread() is threading.main_thread()))
        return original(self, spec, param)

    monkeypatch.setattr(StructuredOutput, "check", recording)
    pattern = "[a-c]{2}x[0-9]"  # a pattern no other test compiles
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "guided_regex": pattern})
    assert r.status_code == 200, r.text
    mine = [on_loop for value, on_loop in calls if value == pattern]
    assert mine and not mine[0], calls  # the engine's own check after it is a cache hit


# --------------------------------------------------------------------------- tools


async def test_named_tool_choice_is_parsed_into_tool_calls(client):
    r = await client.post("/v1/chat/completions", json=chat(tools=TOOLS, tool_choice=NAMED))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert message["role"] == "assistant" and message["content"] is None, message
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert_valid_call(call["function"]["name"], call["function"]["arguments"], "get_weather")


async def test_required_tool_choice_through_the_openai_client(oai):
    resp = await oai.chat.completions.create(
        model="graphcache-tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=8,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert_valid_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
async def test_forced_tool_calls_stream_as_deltas(client, tool_choice):
    r = await client.post(
        "/v1/chat/completions",
        json=chat(tools=TOOLS, tool_choice=tool_choice, stream=True, n=2, parallel_tool_calls=False),
    )
    assert r.status_code == 200, r.text
    choices = reassemble(sse(r.text))
    assert sorted(choices) == [0, 1]
    for c in choices.values():
        assert c["finish"] == "tool_calls" and c["content"] == "", c
        [call] = c["calls"].values()
        assert_valid_call(call["name"], call["arguments"], "get_weather" if tool_choice == NAMED else None)


async def test_streamed_tool_calls_through_the_openai_client(oai):
    stream = await oai.chat.completions.create(
        model="graphcache-tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=9,
        tools=TOOLS,
        tool_choice=NAMED,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for entry in choice.delta.tool_calls or []:
                call = calls.setdefault(entry.index, {"name": "", "arguments": ""})
                call["name"] += (entry.function.name or "") if entry.function else ""
                call["arguments"] += (entry.function.arguments or "") if entry.function else ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert_valid_call(calls[0]["name"], calls[0]["arguments"], "get_weather")


HISTORY = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "days": 2, "metric": true}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sun, then rain"}'},
]


async def test_a_history_with_tool_calls_and_results_renders_and_is_served(client, served):
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": HISTORY,
            "tools": TOOLS,
            "max_tokens": 4,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_ids = body["prompt_token_ids"]
    # /tokenize renders the same chat and tools to the same ids.
    t = await client.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS})
    assert t.status_code == 200, t.text
    assert t.json()["tokens"] == prompt_ids
    rendered = served[1].state.engine.tokenizer.decode(prompt_ids, False)
    assert '"name": "get_weather"' in rendered and '"days": 2' in rendered  # the earlier call
    assert "<tool_response>\n" + HISTORY[3]["content"] + "\n</tool_response>" in rendered  # its result
    assert "You are provided with function signatures" in rendered and "get_time" in rendered  # the tools


async def test_tokenize_tools_change_the_prompt_and_are_checked(client):
    plain = await client.post("/tokenize", json={"messages": MESSAGES})
    with_tools = await client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert plain.status_code == with_tools.status_code == 200
    assert with_tools.json()["count"] > plain.json()["count"]
    r = await client.post("/tokenize", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = await client.post("/tokenize", json={"prompt": "x", "tools": TOOLS})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_choice_none_serves_plain_text(client, stream):
    r = await client.post(
        "/v1/chat/completions",
        json=chat(tools=TOOLS, tool_choice="none", max_tokens=6, ignore_eos=True, stream=stream),
    )
    assert r.status_code == 200, r.text
    if stream:
        [c] = reassemble(sse(r.text)).values()
        assert not c["calls"] and c["finish"] == "length"
    else:
        choice = r.json()["choices"][0]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
        assert isinstance(choice["message"]["content"], str)


async def test_auto_tool_choice_serves_unconstrained_text(client):
    """auto: nothing forces a call; the random model's text is content (no markup in it: no calls)."""
    r = await client.post("/v1/chat/completions", json=chat(tools=TOOLS, max_tokens=6, ignore_eos=True))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"], choice


async def test_concurrent_forced_calls_and_json_share_the_engine(client):
    """Constrained requests of different kinds at once (one batch): each keeps its own grammar."""
    bodies = [
        chat(tools=TOOLS, tool_choice=NAMED, seed=11),
        chat(response_format=json_schema_format(), seed=12),
        chat(guided_choice=["yes", "no"], seed=13),
        chat(max_tokens=5, ignore_eos=True, seed=14),
    ]
    rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    call = rs[0].json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert_valid_call(call["name"], call["arguments"], "get_weather")
    jsonschema.validate(json.loads(rs[1].json()["choices"][0]["message"]["content"]), SCHEMA)
    assert rs[2].json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert rs[3].json()["choices"][0]["finish_reason"] == "length"
