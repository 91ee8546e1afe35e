"""/v1/responses without a server: a Responses body as the chat request it runs as (input items ->
messages, flat tools -> chat tools, tool_choice, text.format, reasoning.effort), the refusals with the
field they name, and the output items and stream events built from chat answers and deltas
(api/openai/responses/)."""

from __future__ import annotations

import json

import pytest
from graphcache.api.openai.protocol import ChatCompletionRequest
from graphcache.api.openai.responses.conversion import chat_fields
from graphcache.api.openai.responses.events import ResponseEvents
from graphcache.api.openai.responses.output import finish_status, output_items, response_usage
from graphcache.api.openai.responses.protocol import ResponsesRequest
from graphcache.engine.errors import InvalidRequest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ARGS = '{"city": "Paris"}'


def chat(**body) -> dict:
    """The chat fields of a Responses body, checked to validate as a chat request."""
    request = ResponsesRequest.model_validate(body)
    request.check()
    fields = chat_fields(request)
    ChatCompletionRequest.model_validate(fields).check()
    return fields


def refused(param: str, **body) -> str:
    request = ResponsesRequest.model_validate(body)
    with pytest.raises(InvalidRequest) as info:
        request.check()
        chat_fields(request)
    assert info.value.param == param, info.value.message
    return info.value.message


# --------------------------------------------------------------------------- input -> messages


def test_text_input_is_one_user_message_after_the_instructions():
    fields = chat(input="Hi", instructions="Be brief.")
    assert fields["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert "add_generation_prompt" not in fields  # the chat's default: true


def test_message_items_with_text_parts():
    fields = chat(
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "C", "annotations": []}]},
            {"role": "user", "content": "D"},
        ]
    )
    assert [(m["role"], m["content"]) for m in fields["messages"]] == [
        ("developer", "Rules."),
        ("user", "AB"),
        ("assistant", "C"),
        ("user", "D"),
    ]


def test_an_agent_turn_reasoning_text_and_calls_is_one_assistant_message():
    """reasoning + message + function_call items (one model turn, as a response returns them) become one
    assistant message; the outputs become tool messages; the next turn's reasoning starts a new one."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS}
    fields = chat(
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Look both up."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            call,
            {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "call_2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Both known."}]},
        ],
        tools=[WEATHER],
    )
    user, turn, out1, out2, thought = fields["messages"]
    assert turn["role"] == "assistant" and turn["content"] == "Checking."
    assert turn["reasoning_content"] == "Look both up."
    assert [c["id"] for c in turn["tool_calls"]] == ["call_1", "call_2"]
    assert turn["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ARGS},
    }
    assert out1 == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert out2["content"] == "rain"
    assert thought == {"role": "assistant", "content": None, "reasoning_content": "Both known."}


def test_a_call_without_a_turn_before_it_opens_one():
    fields = chat(
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": ARGS},
            {"type": "function_call_output", "call_id": "c", "output": "sunny"},
        ]
    )
    assert fields["messages"][1]["role"] == "assistant" and fields["messages"][1]["content"] is None
    assert fields["messages"][1]["tool_calls"][0]["id"] == "c"


def test_an_unfinished_final_assistant_message_is_continued():
    fields = chat(
        input=[
            {"role": "user", "content": "Count"},
            {"role": "assistant", "content": "1, 2,", "status": "incomplete"},
        ]
    )
    assert fields["continue_final_message"] is True and fields["add_generation_prompt"] is False


# --------------------------------------------------------------------------- tools, formats, effort


def test_flat_tools_become_chat_tools_and_tool_choice_names_one():
    fields = chat(
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert fields["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    ]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert fields["parallel_tool_calls"] is False


def test_allowed_tools_keeps_the_listed_tools_with_its_mode():
    other = {**WEATHER, "name": "get_time"}
    fields = chat(
        input="x",
        tools=[WEATHER, other],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_time"}],
        },
    )
    assert fields["tool_choice"] == "required"
    assert [t["function"]["name"] for t in fields["tools"]] == ["get_time"]


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    fields = chat(
        input="x", text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}}
    )
    assert fields["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": schema, "strict": True},
    }
    assert chat(input="x", text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in chat(input="x", text={"format": {"type": "text"}, "verbosity": "low"})


@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("low", True), ("high", True)])
def test_reasoning_effort_reaches_the_template(effort, thinking):
    fields = chat(input="x", reasoning={"effort": effort, "summary": "auto"})
    assert fields["reasoning_effort"] == effort
    assert fields["chat_template_kwargs"] == {"enable_thinking": thinking}
    own = chat(input="x", reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True})
    assert own["chat_template_kwargs"] == {"enable_thinking": True}  # the client's own kwargs win


def test_sampling_fields_and_logprobs_pass_through():
    fields = chat(
        input="x",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        seed=3,
        stop=["\n"],
        include=["message.output_text.logprobs", "reasoning.encrypted_content"],
        top_logprobs=2,
        user="u1",
        metadata={"k": "v"},
        store=True,
    )
    assert {
        k: fields[k]
        for k in ("max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "user")
    } == {
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 3,
        "stop": ["\n"],
        "user": "u1",
    }
    assert fields["logprobs"] is True and fields["top_logprobs"] == 2


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_1"),
        ("conversation", "conv_1"),
        ("background", True),
        ("prompt", {"id": "pmpt_1"}),
        ("truncation", "auto"),
        ("max_tool_calls", 2),
    ],
)
def test_stateful_fields_are_refused_by_name(field, value):
    message = refused(field, input="x", **{field: value})
    assert message.startswith(f"{field} is not supported")


def test_defaults_of_the_stateful_fields_are_accepted():
    chat(input="x", background=False, truncation="disabled", store=False)


@pytest.mark.parametrize(
    ("param", "body", "says"),
    [
        ("tools[0].type", {"tools": [{"type": "web_search"}]}, "only function tools"),
        ("tools[1].name", {"tools": [WEATHER, {"type": "function", "name": "bad name"}]}, "must match"),
        ("tool_choice", {"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "built-in"),
        ("input[0].type", {"input": [{"type": "item_reference", "id": "msg_1"}]}, "not keep"),
        ("input[0].type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, "not supported"),
        (
            "input[0].content[1].type",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_image", "image_url": "x"},
                        ],
                    }
                ]
            },
            "text only",
        ),
        ("input[0].role", {"input": [{"role": "tool", "content": "a"}]}, "role must be"),
        (
            "input[0].arguments",
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "JSON object",
        ),
        ("input[0].call_id", {"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        (
            "input[0].encrypted_content",
            {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
            "encrypted",
        ),
        ("text.format.type", {"text": {"format": {"type": "yaml"}}}, "json_schema"),
        ("text.format.schema", {"text": {"format": {"type": "json_schema", "name": "a"}}}, "schema"),
        ("reasoning.effort", {"reasoning": {"effort": "extreme"}}, "one of"),
        ("top_logprobs", {"top_logprobs": 3}, "include"),
        ("metadata", {"metadata": {f"k{i}": "v" for i in range(17)}}, "at most 16"),
    ],
)
def test_unsupported_input_is_refused_naming_the_field(param, body, says):
    assert says in refused(param, **{"input": "x", **body})


# --------------------------------------------------------------------------- answers and events


def test_a_whole_answer_as_output_items_in_order():
    message = {
        "role": "assistant",
        "content": "Checking.",
        "reasoning": "Think.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
        ],
    }
    items = output_items(message, None, "tool_calls")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
    assert items[1]["content"][0]["text"] == "Checking." and items[1]["status"] == "completed"
    assert {k: items[2][k] for k in ("call_id", "name", "arguments", "status")} == {
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": ARGS,
        "status": "completed",
    }
    half = {**message, "tool_calls": [*message["tool_calls"], {**message["tool_calls"][0], "id": "call_2"}]}
    half["tool_calls"][1] = {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"ci'},
    }
    cut = output_items(half, None, "length")
    assert [i.get("call_id") for i in cut] == [
        None,
        None,
        "call_1",
    ]  # the call cut in its arguments is left out
    assert cut[-1]["status"] == "incomplete"
    cut = output_items({"role": "assistant", "content": "Half"}, None, "length")
    assert cut[0]["status"] == "incomplete"
    assert finish_status("length") == ("incomplete", {"reason": "max_output_tokens"})
    assert finish_status("stop") == ("completed", None)


def test_usage_in_the_responses_shape():
    chat_usage = {
        "prompt_tokens": 5,
        "completion_tokens": 9,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert response_usage(chat_usage, 4) == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 4},
        "total_tokens": 14,
    }


def _deltas():
    """A chat stream's choices: reasoning, text, then two calls (their arguments in pieces)."""
    call = {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": '},
    }
    return [
        {"delta": {"reasoning": "Think"}},
        {"delta": {"reasoning": " more."}},
        {"delta": {"content": "Chec"}, "logprobs": None},
        {"delta": {"content": "king."}},
        {"delta": {"tool_calls": [call]}},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}},
        {
            "delta": {
                "tool_calls": [
                    {**call, "index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}}
                ]
            }
        },
    ]


def test_stream_events_in_openai_order():
    events = ResponseEvents()
    out = events.opening({"id": "resp_1", "status": "in_progress"})
    for choice in _deltas():
        out += events.feed(choice)
    out += events.finish("completed")
    out.append(events.closing({"id": "resp_1", "status": "completed"}))
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert [d["output_index"] for d in out if d["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    assert done[0]["content"][0]["text"] == "Think more."
    assert done[1]["content"][0]["text"] == "Checking."
    assert (done[2]["call_id"], json.loads(done[2]["arguments"])) == ("call_a", {"city": "Paris"})
    assert (done[3]["name"], done[3]["arguments"]) == ("get_time", "{}")
    assert events.output("completed") == done
    # the delta events point at their item: the same id from added to done
    added = {e["output_index"]: e["item"]["id"] for e in out if e["type"] == "response.output_item.added"}
    for e in out:
        if "item_id" in e:
            assert e["item_id"] == added[e["output_index"]], e


def test_a_cut_stream_ends_its_last_item_incomplete():
    events = ResponseEvents()
    events.feed({"delta": {"content": "Half"}})
    closing = events.finish("incomplete")
    assert closing[-1]["item"]["status"] == "incomplete"
    assert events.closing({"status": "incomplete"})["type"] == "response.incomplete"
