"""Shared by the tool-call and reasoning parser tests: an engine whose answers are scripted, the real
chat templates of the model families (tests/data/chat_templates), and the official `openai` client on
the in-process app.

ScriptedEngine is the real Engine (the tiny model, its tokenizer, the request checks), but each
request's answer is the text set in `script`, streamed in the given pieces: what a Llama, Mistral or
Qwen3 model would write, which the tiny random-weight model cannot be made to write word for word
outside a grammar (and a grammar and tools cannot be sent together)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
from graphcache.config import Settings
from graphcache.engine.loop.engine import Engine
from graphcache.engine.sequence import RequestOutput
from graphcache.metrics import Metrics
from helpers_api import serving

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SMALL: dict[str, Any] = {
    "device": "cpu",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    "warmup_decode_sizes": [1],
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
TOOLS = [WEATHER, TIME]
MODEL = "graphcache-tiny"
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time in CET?"}]


class ScriptedEngine(Engine):
    """Answers every request with `script` = (text pieces, finish_reason); records the prompts."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, Metrics())
        self.script: tuple[Sequence[str], str] = (["hello"], "stop")
        self.prompts: list[list[int]] = []

    def generate(
        self, request_id, prompt_token_ids, params=None, *, stream=True, max_tokens_param="max_tokens"
    ):
        pieces, finish = self.script
        self.prompts.append(list(prompt_token_ids))
        chunks = list(pieces) if stream else ["".join(pieces)]

        async def outputs() -> AsyncIterator[RequestOutput]:
            for i, piece in enumerate(chunks):
                last = i == len(chunks) - 1
                yield RequestOutput(
                    request_id,
                    piece,
                    [1],
                    finished=last,
                    finish_reason=finish if last else None,
                    prompt_tokens=len(prompt_token_ids),
                    completion_tokens=i + 1,
                )

        return outputs()


@contextlib.asynccontextmanager
async def scripted_app(cache_dir: Path) -> AsyncIterator[tuple[ScriptedEngine, Any]]:
    settings = Settings(**{"cache_dir": cache_dir, **SMALL})  # flat fields, as Settings takes them
    engine = ScriptedEngine(settings)
    async with serving(settings, engine) as (_, app):
        yield engine, app


def use(
    app: Any,
    template: str,
    tool_call_parser: str = "hermes",
    reasoning_parser: str = "none",
    opens_thinking: bool = False,
) -> None:
    """Serve with the chat template file `template` and the given parsers (what --chat-template,
    --tool-call-parser and --reasoning-parser set at start). `opens_thinking`: the template's generation
    prompt ends with `<think>\n`, as the Qwen3 thinking models' (Qwen3-*-Thinking-2507) and Qwen3.5's do."""
    tokenizer = app.state.engine.tokenizer
    text = (TEMPLATES / template).read_text()
    if opens_thinking:
        generation_prompt = "{{- '<|im_start|>assistant\\n' }}"
        assert text.count(generation_prompt) == 1
        text = text.replace(generation_prompt, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    tokenizer.chat_template = text
    tokenizer._template = None  # compiled again on next use
    app.state.settings.http.tool_call_parser = tool_call_parser
    app.state.settings.http.reasoning_parser = reasoning_parser


def client_of(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=60)
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


def pieces(text: str, size: int = 3) -> list[str]:
    """The text as a model streams it: small deltas that cut through tags and JSON."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def chunkings(text: str, seed: int = 0, randoms: int = 12) -> Iterator[list[str]]:
    """Ways a stream may deliver `text`: whole, a character at a time, cut in two at every position,
    and `randoms` random chunkings (pieces of 1 to 9 characters)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(randoms):
        parts, i = [], 0
        while i < len(text):
            size = rng.randint(1, 9)
            parts.append(text[i : i + size])
            i += size
        yield parts


def run_stream(parser: str, parts: Sequence[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed the parts to a fresh stream parser of the tool_call_parser `parser`: (content, calls as
    {"id", "name", "arguments"} by index). Checks the delta shapes: a call's first entry carries its
    index (the next one), id, type and whole name; later entries only arguments."""
    from graphcache.api.openai.tool_parsers import tool_call_format

    stream = tool_call_format(parser).stream()
    content = ""
    calls: list[dict[str, Any]] = []
    for delta in [*(stream.feed(p) for p in parts), stream.finish()]:
        content += delta.content
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function", entry
                fn = entry["function"]
                calls.append({"id": entry["id"], "name": fn["name"], "arguments": fn["arguments"]})
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert stream.called_tools == bool(calls) and stream.num_calls == len(calls)
    return content, calls


def whole_calls(parser: str, text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole-answer parse, its calls as {"id", "name", "arguments"}."""
    from graphcache.api.openai.tool_parsers import tool_call_format

    content, calls = tool_call_format(parser).parse(text, cut=cut)
    for call in calls:
        assert call["type"] == "function" and set(call) == {"id", "type", "function"}
    return content, [{"id": c["id"], **c["function"]} for c in calls]


async def streamed(oai: openai.AsyncOpenAI, **fields: Any) -> dict[str, Any]:
    """A streamed chat through the client, reassembled: content, reasoning, calls by index, finish."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    stream = await oai.chat.completions.create(stream=True, **fields)
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            reasoning = getattr(delta, "reasoning", None)
            assert reasoning == getattr(delta, "reasoning_content", None), delta  # both names, same text
            out["reasoning"] += reasoning or ""
            for entry in delta.tool_calls or []:
                call = out["calls"].get(entry.index)
                if call is None:
                    assert entry.id and entry.type == "function" and entry.function.name, entry
                    call = out["calls"][entry.index] = {"name": entry.function.name, "arguments": ""}
                else:
                    assert entry.id is None and entry.function.name is None, entry
                call["arguments"] += entry.function.arguments or ""
            if choice.finish_reason is not None:
                assert out["finish"] is None, "a second finish_reason"
                out["finish"] = choice.finish_reason
    return out
