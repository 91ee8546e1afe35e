"""What vLLM's OpenAI-API tests expect of chat and streaming, on the served tiny model (the openai client
and raw HTTP): custom message roles reach the chat template, /invocations routes by the body's shape,
continuous usage stats come only with include_usage and grow from chunk to chunk, and the echo of a
token-id prompt keeps its special tokens.

Expected values come from the tokenizer itself (the rendered template, the decoded ids) and from the
same request sent to the route it stands for.
"""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
from graphcache.config import Settings
from helpers_api import SMALL_SERVER, serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {
    **SMALL_SERVER,
    "drain_timeout_s": 2.0,
}
MODEL = "graphcache-tiny"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    async with serving(Settings(cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)) as (client, app):
        oai = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        yield oai, client, app


def _events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = [f for f in text.split("\n\n") if f]
    return [json.loads(f[6:]) for f in frames if f[6:] != "[DONE]"]


# --------------------------------------------------------------------------- custom roles


async def test_a_custom_role_reaches_the_chat_template(served):
    """vLLM's test_custom_role: a role the API does not know is rendered by the template as it is; the
    string and the parts form of the same content give the same answer."""
    oai, client, app = served
    messages = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    r = await client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    rendered = app.state.engine.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert "<|im_start|>my-custom-role\nwhat is 1+1?<|im_end|>" in rendered
    plain = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0
    )
    parts = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}],
        max_completion_tokens=6,
        temperature=0,
    )
    assert plain.choices[0].message.content == parts.choices[0].message.content
    assert plain.usage.prompt_tokens == r.json()["count"]


@pytest.mark.parametrize("role", ["", "r" * 65])
async def test_an_empty_or_overlong_role_is_a_400_naming_it(served, role):
    _, client, _ = served
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}
    )
    assert r.status_code == 400
    assert "role" in r.json()["error"]["param"]


# --------------------------------------------------------------------------- /invocations


async def test_invocations_answers_a_chat_body_as_the_chat_route(served):
    _, client, _ = served
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}
    direct = await client.post("/v1/chat/completions", json=body)
    routed = await client.post("/invocations", json=body)
    assert direct.status_code == routed.status_code == 200
    a, b = direct.json(), routed.json()
    assert b["object"] == "chat.completion"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


async def test_invocations_answers_a_completion_body_as_the_completion_route(served):
    _, client, _ = served
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    direct = await client.post("/v1/completions", json=body)
    routed = await client.post("/invocations", json=body)
    assert direct.status_code == routed.status_code == 200
    assert routed.json()["object"] == "text_completion"
    assert direct.json()["choices"][0]["text"] == routed.json()["choices"][0]["text"]


async def test_invocations_streams_like_the_route(served):
    _, client, _ = served
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}
    routed = await client.post("/invocations", json=body)
    assert routed.status_code == 200 and routed.headers["content-type"].startswith("text/event-stream")
    direct = await client.post("/v1/completions", json=body)
    text = lambda r: "".join(c["choices"][0]["text"] for c in _events(r.text) if c["choices"])  # noqa: E731
    assert text(routed) == text(direct) and text(routed)


async def test_invocations_gives_the_routes_own_400(served):
    _, client, _ = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 9}
    direct = await client.post("/v1/chat/completions", json=body)
    routed = await client.post("/invocations", json=body)
    assert direct.status_code == routed.status_code == 400
    assert direct.json() == routed.json() and routed.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": "embed me"}, "--runner pooling"),  # /v1/embeddings' own 400 on a generation model
        ({"something": 1}, "messages"),
        ([1, 2], "JSON object"),
    ],
)
async def test_invocations_refuses_what_it_cannot_route_with_a_400(served, body, says):
    _, client, _ = served
    r = await client.post("/invocations", json=body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


async def test_invocations_refuses_a_body_that_is_not_json(served):
    _, client, _ = served
    r = await client.post("/invocations", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# --------------------------------------------------------------------------- streaming usage


async def _stream(client, path: str, body: dict) -> list:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return _events(r.text)


CHAT_BODY = {
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 6,
    "temperature": 0,
    "ignore_eos": True,
}
COMPLETION_BODY = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT_BODY), ("/v1/completions", COMPLETION_BODY)]
)
async def test_continuous_usage_without_include_usage_sends_no_usage(served, path, body):
    """vLLM: continuous_usage_stats counts only with include_usage; alone it adds nothing to the chunks."""
    _, client, _ = served
    chunks = await _stream(client, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert chunks and all(c.get("usage") is None for c in chunks)
    assert all(c["choices"] for c in chunks)  # no final usage chunk either


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT_BODY), ("/v1/completions", COMPLETION_BODY)]
)
async def test_continuous_usage_grows_from_chunk_to_chunk(served, path, body):
    """vLLM's test_*_stream_options: every chunk carries usage; completion_tokens starts at 0 on the
    chat's role chunk and grows with every chunk after it; the last, choice-less chunk has the total."""
    _, client, _ = served
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await _stream(client, path, {**body, "stream_options": opts})
    *with_choices, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    if path.endswith("chat/completions"):
        assert with_choices[0]["choices"][0]["delta"].get("role") == "assistant" and counts[0] == 0
        counts = counts[1:]
    assert counts[0] >= 1 and all(b > a for a, b in zip(counts, counts[1:], strict=False)), counts
    assert counts[-1] == 6
    prompt = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
        for c in chunks
    )


async def test_include_usage_alone_sends_null_usage_then_the_total(served):
    _, client, _ = served
    chunks = await _stream(
        client, "/v1/completions", {**COMPLETION_BODY, "stream_options": {"include_usage": True}}
    )
    *with_choices, final = chunks
    assert all("usage" in c and c["usage"] is None for c in with_choices)
    assert final["usage"]["completion_tokens"] == 6


async def test_continuous_usage_of_several_choices_grows_too(served):
    _, client, _ = served
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await _stream(client, "/v1/chat/completions", {**CHAT_BODY, "n": 2, "stream_options": opts})
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts[:2] == [0, 0]  # the two role chunks
    assert all(b > a for a, b in zip(counts[2:], counts[3:], strict=False)), counts
    assert counts[-1] == 12


# --------------------------------------------------------------------------- echo


async def test_echo_of_a_token_id_prompt_keeps_its_special_tokens(served):
    """vLLM decodes a token-id prompt for echo with its special tokens: they were the client's."""
    oai, _, app = served
    tok = app.state.engine.tokenizer
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>\n", add_special_tokens=True)
    expected = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in expected and "<|im_end|>" in expected
    r = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert r.choices[0].text.startswith(expected)
    streamed = await oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, stream=True
    )
    text = "".join([c.choices[0].text async for c in streamed if c.choices])
    assert text.startswith(expected)


async def test_echo_of_a_text_prompt_is_the_text_as_sent(served):
    oai, _, _ = served
    r = await oai.completions.create(model=MODEL, prompt="Once upon", max_tokens=1, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon") and "<|bos|>" not in r.choices[0].text


# --------------------------------------------------------------------------- priority


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_priority_under_fcfs_is_a_400_naming_the_fix(served, path):
    """vLLM refuses a non-zero priority when priority scheduling is off; 0 is the default and passes."""
    _, client, _ = served
    body = (
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = await client.post(path, json={**body, "max_tokens": 2, "priority": 3})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    ok = await client.post(path, json={**body, "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200, ok.text


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def by_priority(tmp_path_factory):
    settings = Settings(cache_dir=tmp_path_factory.mktemp("cache"), scheduling_policy="priority", **SMALL)
    async with serving(settings) as (client, app):
        yield client, app


@pytest.mark.parametrize("priority", [-3, 0, 7])
async def test_priority_scheduling_takes_the_field(by_priority, priority):
    client, app = by_priority
    r = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": priority, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert app.state.engine.core.scheduler.policy == "priority"


async def test_priority_must_be_an_integer(by_priority):
    client, _ = by_priority
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
