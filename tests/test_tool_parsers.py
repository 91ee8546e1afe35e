"""Tool-call parsers per model family (api/tool_parsers/): hermes, llama3_json and mistral read a whole
answer and a stream of it into the same calls at every split of the text; a last call cut off by
max_tokens is dropped and the complete calls before it are kept; and through the official openai
client, with each family's real chat template rendering the tools, the answers come back as tool_calls,
streamed and not. tool_choice grammars force each family's own markup."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from graphcache.api.tool_calls import tool_choice_spec
from graphcache.api.tool_parsers import tool_call_format
from graphcache.choices import TOOL_CALL_PARSERS
from helpers_parsers import MESSAGES, MODEL, TIME, TOOLS, client_of, pieces, scripted_app, streamed, use

WEATHER_ARGS = {"city": 'Pa"ris {x}', "days": 3}
TIME_ARGS = {"zone": "CET", "nested": {"a": [1, {"b": "}"}], "ok": True}}


def _hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


# Per family: (template file, an answer with two calls, the same answer cut inside its second call,
# the content it has before its calls).
CASES = {
    "hermes": (
        "qwen3_think.jinja",
        "Let me check.\n" + _hermes("get_weather", WEATHER_ARGS) + "\n" + _hermes("get_time", TIME_ARGS),
        "Let me check.\n"
        + _hermes("get_weather", WEATHER_ARGS)
        + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "C',
        "Let me check.",
    ),
    "llama3_json": (
        "llama3_1_tools.jinja",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(WEATHER_ARGS)}}}; '
        f'{{"name": "get_time", "parameters": {json.dumps(TIME_ARGS)}}}',
        f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER_ARGS)}}}; {{"name": "get_time", "parameters": {{"zone": "C',
        None,
    ),
    "mistral": (
        "mistral_tools.jinja",
        f'Let me check. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(WEATHER_ARGS)}}}, '
        f'{{"name": "get_time", "arguments": {json.dumps(TIME_ARGS)}}}]',
        f'Let me check. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {json.dumps(WEATHER_ARGS)}}}, '
        '{"name": "get_time", "arguments": {"zone": "C',
        "Let me check.",
    ),
}
assert set(CASES) == set(TOOL_CALL_PARSERS)


def stream_all(parser: str, parts: list[str]) -> tuple[str, list[dict]]:
    """Feed the parts to a fresh stream parser: (content, calls as {"name", "arguments"} by index)."""
    stream = tool_call_format(parser).stream()
    content, calls = "", []
    for delta in [*(stream.feed(p) for p in parts), stream.finish()]:
        content += delta.content
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry["index"] == len(calls)
                calls.append({"name": entry["function"]["name"], "arguments": entry["function"]["arguments"]})
            else:
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, calls


def names_and_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_whole_answer_parses_into_calls(parser):
    _, text, _, content = CASES[parser]
    found_content, calls = tool_call_format(parser).parse(text)
    assert found_content == content
    assert names_and_args(calls) == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_cut_off_last_call_is_dropped_and_complete_calls_kept(parser):
    _, _, cut, content = CASES[parser]
    found_content, calls = tool_call_format(parser).parse(cut)
    assert found_content == content
    assert names_and_args(calls) == [("get_weather", WEATHER_ARGS)]


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("which", ["whole", "cut"])
def test_streaming_agrees_with_whole_parse_at_every_split(parser, which):
    _, text, cut, _ = CASES[parser]
    text = text if which == "whole" else cut
    content, calls = tool_call_format(parser).parse(text)
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text), pieces(text, 5)]
    for parts in splits:
        got_content, got_calls = stream_all(parser, parts)
        assert got_content == (content or ""), parts
        if which == "whole":
            assert got_calls == expected, parts
        else:  # a stream already announced the cut call; its arguments stop where the text did
            assert got_calls[:1] == expected and len(got_calls) == 2, parts
            assert got_calls[1]["name"] == "get_time", parts
            assert '{"zone": "C"}'.startswith(got_calls[1]["arguments"]), got_calls[1]


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("text", ["just an answer", "", "{not json at all", "[1, 2] is a list"])
def test_plain_answers_stay_content(parser, text):
    assert tool_call_format(parser).parse(text) == (text, [])
    assert stream_all(parser, list(text)) == (text, [])


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
def test_tool_choice_grammar_forces_the_family_markup(parser):
    fmt = tool_call_format(parser)
    grammar = tool_choice_spec(TOOLS, "required", True, fmt).value
    assert json.dumps(fmt.head("get_weather")) in grammar and json.dumps(fmt.separator) in grammar
    named = tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, fmt).value
    assert "get_weather" not in named and json.dumps(fmt.head("get_time")) in named


# --------------------------------------------------------------------------- through the openai client

pytestmark_async = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(tmp_path_factory):
    async with scripted_app(tmp_path_factory.mktemp("cache")) as pair:
        yield pair


@pytestmark_async
@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_calls_through_the_openai_client(app, parser, stream):
    engine, served = app
    template, text, _, content = CASES[parser]
    use(served, template, tool_call_parser=parser)
    engine.script = (pieces(text), "stop")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200}
    if stream:
        got = await streamed(oai, **fields)
        assert got["content"] == (content or "")
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
        finish = got["finish"]
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert message.content == content
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        finish = answer.choices[0].finish_reason
    assert calls == [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    assert finish == "tool_calls"
    prompt = served.state.engine.tokenizer.decode(engine.prompts[-1], False)
    assert (
        "get_weather" in prompt and "The time in a zone." in prompt
    )  # the family's template showed the tools


@pytestmark_async
@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("stream", [False, True])
async def test_cut_off_parallel_calls_keep_the_complete_one(app, parser, stream):
    engine, served = app
    template, _, cut, content = CASES[parser]
    use(served, template, tool_call_parser=parser)
    engine.script = (pieces(cut), "length")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 40}
    if stream:
        got = await streamed(oai, **fields)
        first = got["calls"][0]
        assert (first["name"], json.loads(first["arguments"])) == ("get_weather", WEATHER_ARGS)
        assert got["content"] == (content or "") and got["finish"] == "length"
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", WEATHER_ARGS)
        ]
        assert answer.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- grammars on the tiny model

CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "enum": [1, 2]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def runner():
    from graphcache.engine.worker.runner import ModelRunner
    from helpers_model import cpu_settings, tiny_checkpoint

    return ModelRunner(cpu_settings(tiny_checkpoint("llama"), max_model_len=512, num_kv_blocks=128))


@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_makes_the_random_model_write_the_family_markup(runner, parser, choice):
    """The grammar a tool_choice compiles to (llguidance, on the tiny model's tokenizer) forces text
    that the same family's parser reads back as a valid call, whole and streamed."""
    from graphcache.engine.sample.structured import StructuredOutput
    from test_structured import generate

    structured = StructuredOutput(runner.tokenizer, runner.vocab_size)
    fmt = tool_call_format(parser)
    spec = tool_choice_spec([CITY_TOOL, TIME], choice, False, fmt)
    structured.check(spec, param="tools")
    # seed 6: a seeded walk that closes the call within 150 tokens for every family (most seeds miss one)
    text, _ = generate(runner, structured, spec, 6, max_tokens=150)
    content, calls = fmt.parse(text)
    assert content is None and len(calls) == 1, text
    name, args = names_and_args(calls)[0]
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo") and args["days"] in (1, 2), text
    else:
        assert name == "get_time" and isinstance(args, dict), text
    assert stream_all(parser, list(text))[1] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
    ]


@pytestmark_async
@pytest.mark.parametrize("parser", TOOL_CALL_PARSERS)
async def test_a_history_with_a_call_and_its_result_renders_in_each_template(app, parser):
    """The family's template renders the earlier call and its result; the answer after it is content."""
    engine, served = app
    use(served, CASES[parser][0], tool_call_parser=parser)
    engine.script = (pieces("It is sunny in Paris."), "stop")
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call12345",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call12345", "content": "sunny, 21C"},
    ]
    answer = await client_of(served).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=50
    )
    assert answer.choices[0].message.content == "It is sunny in Paris."
    assert not answer.choices[0].message.tool_calls and answer.choices[0].finish_reason == "stop"
    prompt = served.state.engine.tokenizer.decode(engine.prompts[-1], False)
    assert "sunny, 21C" in prompt and '"city": "Paris"' in prompt
