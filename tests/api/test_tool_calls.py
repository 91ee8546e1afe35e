"""Hermes tool calls (api/openai/tool_calls.py): complete and streaming parsing agree at every split of
the text, markup never leaks into content, tools/tool_choice are validated, and a tool_choice
constraint makes the random tiny model write a parseable call of the named function."""

from __future__ import annotations

import json

import pytest
from graphcache.api.openai.tool_calls import (
    ToolCallStreamParser,
    check_tools,
    parse_tool_calls,
    tool_choice_spec,
)
from graphcache.engine.errors import InvalidRequest
from test_structured import generate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "enum": [0, 1, 2]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}

ONE_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1, "nested": {"a": [1, {"b": "}"}]}}}\n</tool_call>'
)


def test_parse_single_call_with_content():
    content, calls = parse_tool_calls(ONE_CALL)
    assert content == "Let me check."
    assert len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}


def test_parse_parallel_calls_keep_raw_arguments():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[0]["function"]["arguments"] == '{"city": "Pa\\"ris {x}", "unit": "c"}'
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": 1, "nested": {"a": [1, {"b": "}"}]}}
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "just an answer, no tools",
        "",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
    ],
)
def test_no_valid_call_is_all_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_unterminated_last_block_and_other_layouts():
    content, calls = parse_tool_calls('<tool_call>\n{"arguments": {"x": 1}, "name": "f"}')
    assert content is None and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "g", "parameters": {"y": "z"}}</tool_call>')
    assert calls[0]["function"] == {"name": "g", "arguments": '{"y": "z"}'}


def stream(pieces: list[str]) -> tuple[str, list[dict]]:
    """Run the streaming parser over pieces; (content, calls assembled from the deltas)."""
    parser, content, calls = ToolCallStreamParser(), "", {}
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            if "id" in tc:  # the header comes first and once
                assert tc["index"] not in calls and tc["index"] == len(calls) and tc["type"] == "function"
                calls[tc["index"]] = {
                    "id": tc["id"],
                    "name": tc["function"]["name"],
                    "arguments": tc["function"].get("arguments", ""),
                }
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert parser.called_tools == bool(calls)
    return content, [calls[i] for i in range(len(calls))]


TEXTS = [
    ONE_CALL,
    TWO_CALLS,
    "plain text only <tool",
    "no call, trailing space  \n",
    "a < b and <tool_c is not a tag\n",
    '  \n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>  ',
    '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>',
]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_complete_at_every_split(text):
    want_content, want_calls = parse_tool_calls(text)
    want = (want_content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls])
    # whole; one char at a time; and every split into two pieces
    splits = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        content, calls = stream(pieces)
        assert "<tool_call" not in content or not want_calls
        assert (content, [(c["name"], c["arguments"]) for c in calls]) == want, pieces


def test_streaming_announces_name_before_arguments_complete():
    parser = ToolCallStreamParser()
    first = parser.feed('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Sure."
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    second = parser.feed('ris"}}\n</tool_')
    assert second.tool_calls == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    assert not parser.feed("call>") and not parser.finish()


# --- tools and tool_choice -----------------------------------------------------------------


def test_auto_and_none_constrain_nothing():
    assert tool_choice_spec([WEATHER], "auto") is None
    assert tool_choice_spec([WEATHER], "none") is None
    assert tool_choice_spec(None, None) is None
    assert check_tools([{"type": "function", "function": {"name": "noargs"}}]) == {
        "noargs": {"type": "object"}
    }


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER, WEATHER], "auto", "tools"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools"),
        ([{"type": "retrieval"}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools"),
        ("get_weather", "auto", "tools"),
    ],
)
def test_invalid_tools_and_tool_choice(tools, choice, param):
    with pytest.raises(InvalidRequest) as info:
        tool_choice_spec(tools, choice)
    assert info.value.param == param


@pytest.fixture(scope="module")
def runner():
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    # Room for the tools system prompt (~480 tokens on the tiny vocabulary) plus the call.
    return ModelRunner(
        cpu_settings(
            tiny_checkpoint("llama"), max_model_len=1024, max_num_batched_tokens=1024, num_kv_blocks=512
        )
    )


@pytest.fixture(scope="module")
def structured(runner):
    from graphcache.engine.sample.structured import StructuredOutput

    return StructuredOutput(runner.tokenizer, runner.vocab_size)


@pytest.mark.parametrize("seed", [0, 1])
def test_named_tool_choice_forces_a_parseable_call(runner, structured, seed):
    spec = tool_choice_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    structured.check(spec, param="tools")
    prompt = runner.tokenizer.encode_chat(
        [{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME]
    )
    text, _ = generate(runner, structured, spec, seed, max_tokens=120, prompt=prompt)
    content, calls = parse_tool_calls(text)
    assert content is None and len(calls) == 1, text
    assert calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 10
    assert stream(list(text))[1][0]["arguments"] == calls[0]["function"]["arguments"]


def test_required_tool_choice_calls_listed_tools(runner, structured):
    spec = tool_choice_spec([WEATHER, TIME], "required")
    text, _ = generate(runner, structured, spec, seed=3, max_tokens=200)
    content, calls = parse_tool_calls(text)
    assert content is None and calls, text
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_time":
            assert args["zone"] in (0, 1, 2)
        else:
            assert call["function"]["name"] == "get_weather" and args["unit"] in ("c", "f")


def test_single_call_grammar_when_not_parallel(structured):
    from graphcache.engine.sample.structured import accept, is_done
    from graphcache.engine.sequence import SamplingParams, Sequence

    spec = tool_choice_spec([TIME], "required", parallel_tool_calls=False)
    seq = Sequence("r", [5], SamplingParams(structured=spec))
    seq.grammar = structured.new_matcher(spec)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
    for t in structured.ll_tokenizer.tokenize_str(call):
        assert accept(seq, t)
    assert is_done(seq)  # one call, nothing may follow
