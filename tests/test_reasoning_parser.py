"""Reasoning parsers (api/reasoning.py): `<think>...</think>` text goes to reasoning_content, streamed
deltas add up to the whole answer's split at every cut of the text, and through the openai client with
Qwen3's real template the reasoning, the content and a tool call after the reasoning all come back
apart, streamed and not."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from graphcache.api.reasoning import ReasoningStream, split_reasoning
from helpers_parsers import MESSAGES, MODEL, TOOLS, client_of, pieces, scripted_app, streamed, use

THOUGHT = "The user wants Paris. <b>not a tag</b> and a < sign."
ANSWER = "\n\nIt is sunny."

# (parser, answer text, expected reasoning_content, expected content)
SPLITS = [
    ("qwen3", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", f"<think>\n\n</think>\n\n{ANSWER}", "\n\n", "\n\n" + ANSWER),  # an empty thought, kept as is
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", f"<think>{THOUGHT}", THOUGHT, ""),  # cut off while thinking
    ("deepseek_r1", f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),  # the template opened <think>
    ("deepseek_r1", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("deepseek_r1", THOUGHT, THOUGHT, ""),  # never closed: all reasoning
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), SPLITS)
def test_whole_answer_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), SPLITS)
def test_stream_agrees_with_whole_split_at_every_cut(parser, text, reasoning, content):
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text), pieces(text, 4)]
    for parts in cuts:
        stream = ReasoningStream(parser)
        got_reasoning = got_content = ""
        for delta in [*(stream.feed(p) for p in parts), stream.finish()]:
            assert "<think>" not in delta.reasoning + delta.content, parts
            got_reasoning += delta.reasoning
            got_content += delta.content
        assert (got_reasoning or None, got_content) == (reasoning, content), parts


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningStream("nope")


# --------------------------------------------------------------------------- through the openai client

on_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(tmp_path_factory):
    async with scripted_app(tmp_path_factory.mktemp("cache")) as pair:
        yield pair


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_split_through_the_openai_client(app, stream):
    engine, served = app
    use(served, "qwen3_think.jinja", reasoning_parser="qwen3")
    engine.script = (pieces(f"<think>{THOUGHT}</think>{ANSWER}"), "stop")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100}
    if stream:
        got = await streamed(oai, **fields)
        assert (got["reasoning"], got["content"], got["finish"]) == (THOUGHT, ANSWER, "stop")
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_deepseek_r1_answer_cut_while_thinking_is_all_reasoning(app, stream):
    engine, served = app
    use(served, "qwen3_think.jinja", reasoning_parser="deepseek_r1")
    engine.script = (pieces(THOUGHT), "length")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10}
    if stream:
        got = await streamed(oai, **fields)
        assert (got["reasoning"], got["content"], got["finish"]) == (THOUGHT, "", "length")
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert (message.reasoning_content, message.content) == (THOUGHT, None)


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_then_tool_call(app, stream):
    """Qwen3 thinks, then calls: the reasoning is split off first, the call read from the rest (a
    <tool_call> written inside the reasoning is thought, not a call)."""
    engine, served = app
    use(served, "qwen3_think.jinja", tool_call_parser="hermes", reasoning_parser="qwen3")
    thought = 'I could write <tool_call>{"name": "get_time", "arguments": {}}</tool_call> but no.'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine.script = (pieces(f"<think>{thought}</think>\n\n{call}"), "stop")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100}
    if stream:
        got = await streamed(oai, **fields)
        assert got["reasoning"] == thought and got["content"] == "" and got["finish"] == "tool_calls"
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert message.reasoning_content == thought and message.content is None
        assert answer.choices[0].finish_reason == "tool_calls"
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    prompt = served.state.engine.tokenizer.decode(engine.prompts[-1], False)
    assert "<tools>" in prompt and prompt.endswith("<|im_start|>assistant\n")


@on_module_loop
async def test_no_reasoning_parser_keeps_think_in_content(app):
    engine, served = app
    use(served, "qwen3_think.jinja")
    engine.script = (pieces(f"<think>{THOUGHT}</think>{ANSWER}"), "stop")
    answer = await client_of(served).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100)
    message = answer.choices[0].message
    assert message.content == f"<think>{THOUGHT}</think>{ANSWER}"
    assert getattr(message, "reasoning_content", None) is None
