"""/v1/responses through the official openai client's `responses` API, against the in-process server:
the embedded tiny model (text, instructions, a forced function call the client parses, its output sent
back, json_schema through `responses.parse`, max_output_tokens cutting it, logprobs, whole and streamed,
OpenAI's event sequence and SSE framing), a scripted engine for what the random-weight model cannot be
made to write (reasoning split by the qwen3 parser, a call after text through the hermes parser, the
prompt the items render to), and every refusal as a 400 naming the field."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import pytest_asyncio
from graphcache.api.server.app import create_app
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.metrics import Metrics
from helpers_api import EngineNotNeeded, drive_then_disconnect, serving
from helpers_parsers import SMALL, client_of, pieces, scripted_app, use
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

MODEL = "graphcache-tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ENDLESS = {"ignore_eos": True}  # the answer runs to max_output_tokens
on_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tmp_path_factory):
    settings = Settings(**{"cache_dir": tmp_path_factory.mktemp("cache"), **SMALL})
    async with serving(settings, Engine(settings, Metrics())) as (_, app):
        yield app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scripted(tmp_path_factory):
    async with scripted_app(tmp_path_factory.mktemp("cache")) as (engine, app):
        tokenizer = app.state.engine.tokenizer
        original = tokenizer.chat_template
        yield engine, app
        tokenizer.chat_template, tokenizer._template = original, None


# --------------------------------------------------------------------------- the tiny model


@on_module_loop
async def test_text_answer_cut_by_max_output_tokens(live):
    oai = client_of(live)
    r = await oai.responses.create(
        model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5, extra_body=ENDLESS
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    message = r.output[0]
    assert message.role == "assistant" and message.status == "incomplete" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text != ""
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + 5
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == ("Be brief.", 5, 1.0, False)


@on_module_loop
async def test_streamed_events_in_order_add_up_to_the_response(live):
    oai = client_of(live)
    stream = await oai.responses.create(
        model=MODEL,
        input="Hello",
        max_output_tokens=4,
        stream=True,
        extra_body=ENDLESS,
        metadata={"run": "7"},
    )
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * (len(kinds) - 8),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.id == events[0].response.id and final.metadata == {"run": "7"}
    assert final.output_text == text == events[-2].item.content[0].text
    assert final.usage.output_tokens == 4


@on_module_loop
async def test_sse_framing_is_event_and_data_lines(live):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True, **ENDLESS}
    transport = httpx.ASGITransport(app=live)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://t") as http,
        http.stream("POST", "/v1/responses", json=body) as response,
    ):
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    blocks = [b for b in text.split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == event[len("event: ") :]
    assert "[DONE]" not in text  # the Responses API ends its stream without one


async def _forced_call(oai, **fields):
    return await oai.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300,
        extra_body={"seed": 1},
        **fields,
    )


@on_module_loop
async def test_forced_tool_choice_returns_a_function_call_item_and_its_output_goes_back(live):
    oai = client_of(live)
    r = await _forced_call(oai)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    # the agent loop: the call and its output go back as input items
    follow = await oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *r.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=3,
        extra_body=ENDLESS,
    )
    assert follow.status == "incomplete" and follow.output[-1].type == "message"


@on_module_loop
async def test_streamed_required_call_through_responses_stream(live):
    oai = client_of(live)
    async with oai.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        extra_body={"seed": 1},
    ) as stream:
        fragments = [e.delta async for e in stream if e.type == "response.function_call_arguments.delta"]
        final = await stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == "".join(fragments)
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


@on_module_loop
async def test_a_required_call_cut_by_max_output_tokens_is_left_out(live):
    """As vLLM's test_max_tokens_with_tool_choice_required: no function_call item, the response incomplete."""
    oai = client_of(live)
    r = await oai.responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=10
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert all(item.type != "function_call" for item in r.output)


class Verdict(BaseModel):
    ok: bool


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_format_through_responses_parse(live, stream):
    oai = client_of(live)
    fields = {"model": MODEL, "input": "Is it fine?", "text_format": Verdict, "max_output_tokens": 200}
    if stream:
        async with oai.responses.stream(**fields, extra_body={"seed": 2}) as s:
            async for _ in s:
                pass
            r = await s.get_final_response()
    else:
        r = await oai.responses.parse(**fields, extra_body={"seed": 2})
    assert r.status == "completed" and isinstance(r.output_parsed, Verdict)
    assert r.text.format.type == "json_schema"


@on_module_loop
async def test_output_text_logprobs(live):
    oai = client_of(live)
    r = await oai.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=3,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body=ENDLESS,
    )
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


@on_module_loop
async def test_an_invalid_schema_names_text_format(live):
    oai = client_of(live)
    bad = {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object", "minProperties": "x"}}}
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(model=MODEL, input="x", text=bad)
    assert info.value.body["param"] == "text.format", info.value.body


@on_module_loop
async def test_a_client_that_leaves_a_stream_aborts_its_request(live):
    before = await _aborted(live)
    body = {"model": MODEL, "input": "A long story", "max_output_tokens": 1000, "stream": True, **ENDLESS}
    sent = await drive_then_disconnect(live, body, "http.response.body", "/v1/responses")
    assert sent[0]["status"] == 200
    engine = live.state.engine
    for _ in range(200):  # the abort travels through the engine inbox; blocks are freed between steps
        if not engine.stats()["in_flight"]:
            break
        await asyncio.sleep(0.02)
    stats = engine.stats()
    assert stats["in_flight"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert await _aborted(live) == before + 1


async def _aborted(app) -> float:
    """graphcache_requests_finished_total{reason="abort"} from /metrics."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "graphcache_requests_finished_total" and sample.labels.get("reason") == "abort":
                return sample.value
    return 0.0


# --------------------------------------------------------------------------- scripted answers

THOUGHT = "The user wants Paris."
ANSWER = "\n\nIt is sunny."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_comes_back_as_a_reasoning_item(scripted, stream):
    engine, app = scripted
    use(app, "qwen3_think.jinja", reasoning_parser="qwen3")
    engine.script = (pieces(f"<think>{THOUGHT}</think>{ANSWER}"), "stop")
    oai = client_of(app)
    fields = {"model": MODEL, "input": "Weather?", "reasoning": {"effort": "high"}, "max_output_tokens": 100}
    if stream:
        async with oai.responses.stream(**fields) as s:
            events = [e async for e in s]
            r = await s.get_final_response()
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
        assert_paired([e.type for e in events])
    else:
        r = await oai.responses.create(**fields)
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == THOUGHT and r.output[0].id.startswith("rs_")
    assert r.output_text == ANSWER
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    assert r.reasoning.effort == "high"


def assert_paired(kinds: list[str]) -> None:
    """vLLM's test_function_calling_with_streaming_types: every done closes the added (or delta) that
    opened it, and nothing is left open at the end."""
    opens = {
        "response.completed": "response.created",
        "response.output_item.done": "response.output_item.added",
        "response.output_text.done": "response.output_text.delta",
        "response.content_part.done": "response.content_part.added",
        "response.reasoning_text.done": "response.reasoning_text.delta",
        "response.function_call_arguments.done": "response.function_call_arguments.delta",
    }
    stack: list[str] = []
    for kind in kinds:
        if kind == "response.created" or kind.endswith("added"):
            stack.append(kind)
        elif kind.endswith("delta"):
            if stack[-1] != kind:
                stack.append(kind)
        elif kind.endswith("done") or kind == "response.completed":
            assert stack.pop() == opens[kind], kinds
    assert not stack, kinds


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_after_text_is_a_message_then_a_function_call(scripted, stream):
    engine, app = scripted
    use(app, "qwen3_think.jinja", tool_call_parser="hermes")
    engine.script = (pieces(f"Checking.\n{CALL}"), "stop")
    oai = client_of(app)
    fields = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "max_output_tokens": 100}
    if stream:
        async with oai.responses.stream(**fields) as s:
            assert_paired([e.type async for e in s])
            r = await s.get_final_response()
    else:
        r = await oai.responses.create(**fields)
    assert [item.type for item in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking."
    assert (r.output[1].name, json.loads(r.output[1].arguments)) == ("get_weather", {"city": "Paris"})


@on_module_loop
async def test_a_failure_mid_stream_ends_with_error_and_response_failed(scripted):
    engine, app = scripted
    use(app, "qwen3_think.jinja")
    engine.script = (["Partial", " answer"], "error")
    oai = client_of(app)
    stream = await oai.responses.create(model=MODEL, input="Hi", stream=True)
    events = [e async for e in stream]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    error, failed = events[-2:]
    assert error.code == "engine_error" and error.message
    assert failed.response.status == "failed" and failed.response.error.message == error.message
    assert failed.response.output_text == "Partial"  # what was streamed before the failure
    assert [e.sequence_number for e in events] == list(range(len(events)))


REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.id }}>{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@on_module_loop
async def test_items_render_as_the_chat_they_stand_for(scripted):
    """instructions first as a system message; a turn's reasoning, text and call in one assistant
    message (reasoning as reasoning_content), the call's output a tool message."""
    engine, app = scripted
    tokenizer = app.state.engine.tokenizer
    tokenizer.chat_template, tokenizer._template = REASONING_TEMPLATE, None
    engine.script = (["ok"], "stop")
    oai = client_of(app)
    await oai.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Look it up."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "call_9",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_9", "output": "sunny"},
        ],
    )
    prompt = tokenizer.decode(engine.prompts[-1], False)
    assert prompt + "\n" == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>Look it up.</think>Checking.<call get_weather call_9><|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------- refusals


@pytest.fixture
async def refusing():
    app = create_app(
        Settings(max_num_seqs=4, max_num_batched_tokens=64), engine=EngineNotNeeded(), metrics=Metrics()
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        yield http, app


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "input[0].encrypted_content",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]},
            "input[0].arguments",
        ),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"temperature": 3}, "temperature"),
        ({"top_k": "5"}, "top_k"),  # a forwarded field, checked by the chat request
        (
            {"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
            "text.format",
        ),
    ],
)
async def test_refusals_are_400s_naming_the_field(refusing, body, param):
    http, _ = refusing
    response = await http.post("/v1/responses", json={"model": MODEL, "input": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


async def test_the_client_raises_on_a_stateful_request(refusing):
    _, app = refusing
    oai = client_of(app)
    with pytest.raises(openai.BadRequestError, match="previous_response_id is not supported"):
        await oai.responses.create(model=MODEL, input="again", previous_response_id="resp_1")


async def test_stored_responses_do_not_exist(refusing):
    http, _ = refusing
    for response in (await http.get("/v1/responses/resp_1"), await http.post("/v1/responses/resp_1/cancel")):
        assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"


@on_module_loop
async def test_chat_history_reasoning_content_reaches_the_template(scripted):
    """The same field on /v1/chat/completions: an assistant message's reasoning_content is rendered."""
    engine, app = scripted
    tokenizer = app.state.engine.tokenizer
    tokenizer.chat_template, tokenizer._template = REASONING_TEMPLATE, None
    engine.script = (["ok"], "stop")
    await client_of(app).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
            {"role": "user", "content": "Again"},
        ],
    )
    assert "<|im_start|>assistant\n<think>Greet back.</think>Hello.<|im_end|>" in tokenizer.decode(
        engine.prompts[-1], False
    )
