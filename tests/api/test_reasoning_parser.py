"""Reasoning parsers (api/openai/reasoning.py): the thinking goes to `reasoning` and `reasoning_content`,
streamed deltas add up to the whole answer's split at every chunking of the text, qwen3 follows the
template (thinking on, `<think>` in the prompt or written by the model; thinking off by
enable_thinking or a prompt that closed it), and through the openai client with Qwen3's real template
the reasoning, the content and a tool call after the reasoning all come back apart, streamed and not.
vLLM's own cases for these parsers are in test_vllm_parser_cases.py."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from graphcache.api.openai.reasoning import ReasoningStream, split_reasoning
from helpers_parsers import MESSAGES, MODEL, TOOLS, chunkings, client_of, pieces, scripted_app, streamed, use

THOUGHT = "The user wants Paris. <b>not a tag</b> and a < sign."
ANSWER = "\n\nIt is sunny."
HYBRID = "<|im_start|>assistant\n"  # Qwen3's template, thinking on: the model writes <think>
THINKING = "<|im_start|>assistant\n<think>\n"  # Qwen3 thinking models, Qwen3.5: <think> in the prompt
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's template, enable_thinking false
OFF = {"enable_thinking": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (parser, prompt end, chat_template_kwargs, answer, reasoning, content)
SPLITS = [
    ("qwen3", HYBRID, None, f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", THINKING, None, f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", THINKING, None, f"\n{THOUGHT}\n</think>{ANSWER}", f"\n{THOUGHT}\n", ANSWER),
    ("qwen3", HYBRID, None, "<think>\n\n</think>\n\nHi.", "\n\n", "\n\nHi."),  # an empty thought, kept as is
    ("qwen3", HYBRID, None, "Cut while thinking", "Cut while thinking", ""),  # never closed: all reasoning
    ("qwen3", THINKING, None, f"{THOUGHT}\n{CALL}", f"{THOUGHT}\n", CALL),  # a call ends the reasoning
    ("qwen3", HYBRID, OFF, f"No thinking here. {CALL}", None, f"No thinking here. {CALL}"),
    ("qwen3", CLOSED, None, "No thinking here.", None, "No thinking here."),  # the prompt closed it
    ("qwen3", CLOSED, OFF, f"Then <think>{THOUGHT}</think>!", THOUGHT, "Then !"),  # thought it anyway
    ("deepseek_r1", "", None, f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),  # the template opened <think>
    ("deepseek_r1", "", None, f"  <think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("deepseek_r1", "", None, THOUGHT, THOUGHT, ""),  # never closed: all reasoning
    ("deepseek_r1", "", None, f"I write {CALL} in thought</think>ok", f"I write {CALL} in thought", "ok"),
    ("deepseek_r1", "", None, "", "", ""),  # in the reasoning, none written
    ("deepseek_r1", "</think>\n\n", None, "Plain.", None, "Plain."),  # a template that closed it
]


@pytest.mark.parametrize(("parser", "tail", "kwargs", "text", "reasoning", "content"), SPLITS)
def test_whole_answer_split(parser, tail, kwargs, text, reasoning, content):
    assert split_reasoning(parser, text, tail, kwargs) == (reasoning, content)


@pytest.mark.parametrize(("parser", "tail", "kwargs", "text", "reasoning", "content"), SPLITS)
def test_stream_agrees_with_whole_split_at_every_chunking(parser, tail, kwargs, text, reasoning, content):
    for parts in chunkings(text):
        stream = ReasoningStream(parser, tail, kwargs)
        got_reasoning = got_content = ""
        for delta in [*(stream.feed(p) for p in parts), stream.finish()]:
            assert "<think>" not in delta.reasoning + delta.content, parts
            got_reasoning += delta.reasoning
            got_content += delta.content
        # a stream sends no empty reasoning: "" and None both read as none
        assert (got_reasoning or None, got_content) == (reasoning or None, content), parts


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1"):
        ReasoningStream("nope")


# --------------------------------------------------------------------------- through the openai client

on_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(tmp_path_factory):
    async with scripted_app(tmp_path_factory.mktemp("cache")) as pair:
        yield pair


def _reasoning_of(message) -> str | None:
    """A message's reasoning, checked to come under both names."""
    reasoning = getattr(message, "reasoning", None)
    assert reasoning == getattr(message, "reasoning_content", None), message
    return reasoning


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
        assert (_reasoning_of(message), message.content) == (THOUGHT, ANSWER)
        raw = answer.model_dump()["choices"][0]["message"]
        assert raw["reasoning"] == raw["reasoning_content"] == THOUGHT


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_model_with_think_in_the_prompt(app, stream):
    """A Qwen3 thinking model's template opens <think> in the prompt: the answer starts inside the
    reasoning and closes it with </think>, which never reaches the content."""
    engine, served = app
    use(served, "qwen3_think.jinja", reasoning_parser="qwen3", opens_thinking=True)
    engine.script = (pieces(f"{THOUGHT}\n</think>{ANSWER}"), "stop")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100}
    prompt_end = "<|im_start|>assistant\n<think>\n"
    if stream:
        got = await streamed(oai, **fields)
        assert (got["reasoning"], got["content"]) == (f"{THOUGHT}\n", ANSWER)
    else:
        message = (await oai.chat.completions.create(**fields)).choices[0].message
        assert (_reasoning_of(message), message.content) == (f"{THOUGHT}\n", ANSWER)
    assert served.state.engine.tokenizer.decode(engine.prompts[-1], False).endswith(prompt_end)


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_off_is_all_content(app, stream):
    """enable_thinking false: Qwen3's template closes an empty thought in the prompt; the answer is
    content, a tool call in it a call."""
    engine, served = app
    use(served, "qwen3_think.jinja", tool_call_parser="hermes", reasoning_parser="qwen3")
    engine.script = (pieces(f"Checking.\n{CALL}"), "stop")
    oai = client_of(served)
    fields = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 100,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    if stream:
        got = await streamed(oai, **fields)
        assert (got["reasoning"], got["content"], got["finish"]) == ("", "Checking.", "tool_calls")
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert (_reasoning_of(message), message.content) == (None, "Checking.")
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert served.state.engine.tokenizer.decode(engine.prompts[-1], False).endswith("</think>\n\n")


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
        assert (_reasoning_of(message), message.content) == (THOUGHT, None)


@on_module_loop
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("closed", [True, False], ids=["think_closed", "call_closes_think"])
async def test_reasoning_then_tool_call(app, stream, closed):
    """Qwen3 thinks, then calls: the reasoning is split off first, the call read from the rest. The
    reasoning ends at </think>, or at a <tool_call> the model writes without closing it (as vLLM's
    qwen3 parser reads Qwen3.5 and Qwen3-Coder answers)."""
    engine, served = app
    use(served, "qwen3_think.jinja", tool_call_parser="hermes", reasoning_parser="qwen3")
    thought = "I should look the weather up."
    answer_text = f"<think>{thought}</think>\n\n{CALL}" if closed else f"<think>{thought}\n\n{CALL}"
    engine.script = (pieces(answer_text), "stop")
    oai = client_of(served)
    fields = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 100}
    want_thought = thought if closed else f"{thought}\n\n"
    if stream:
        got = await streamed(oai, **fields)
        assert got["reasoning"] == want_thought and got["content"] == "" and got["finish"] == "tool_calls"
        calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())]
    else:
        answer = await oai.chat.completions.create(**fields)
        message = answer.choices[0].message
        assert _reasoning_of(message) == want_thought and message.content is None
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
    assert _reasoning_of(message) is None
