"""Llama 3.1-3.3 JSON tool calls, as Meta's tool-calling chat template asks for them:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

the whole answer is the call (the `<|python_tag|>` is optional, and only visible when special tokens are
kept); several calls are separated by ";". An answer that does not start with "{" has no calls and is all
content; one that does is calls only (content None), as vLLM's llama3_json parser reads it. A last call
cut off by max_tokens is dropped and the complete calls before it kept; any other object that is not a
call {"name", "parameters" or "arguments"} makes the whole answer content.
"""

from __future__ import annotations

import json
from typing import Any

from graphcache.api.tool_parsers.base import ToolCallDelta, ToolCallFormat, new_call
from graphcache.api.tool_parsers.json_calls import JsonCallsStream, call_of, read_partial

__all__ = ["FORMAT", "PYTHON_TAG", "Llama3JsonStream", "parse_tool_calls", "read_calls"]

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _calls_start(text: str) -> int | None:
    """Where the calls begin ("{" after optional whitespace and python tag), or None: plain content."""
    rest = text.lstrip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
    return len(text) - len(rest) if rest.startswith("{") else None


def read_calls(text: str) -> tuple[list[Any], int]:
    """Call objects separated by ";" (and whitespace): (objects, how many are complete)."""
    calls: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos >= len(text):
            return calls, len(calls)
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            partial = read_partial(text[pos:])
            if partial is not None:
                calls.append(partial)
            return calls, len(calls) - (partial is not None)
        calls.append(obj)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    start = _calls_start(text)
    if start is None:
        return text, []
    objects, complete = read_calls(text[start:])
    parsed = [call_of(obj) for obj in objects[:complete]]
    if not parsed or any(p is None for p in parsed):
        return text, []
    return None, [new_call(*p) for p in parsed if p is not None]


class Llama3JsonStream:
    """Holds the answer's start until its first visible character says calls ("{") or content."""

    def __init__(self) -> None:
        self._all = ""  # everything fed: the content while undecided, or if no call comes of it
        self._mode: str | None = None  # None: undecided; "content"; "calls"
        self._calls = JsonCallsStream(read_calls)

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    @property
    def called_tools(self) -> bool:
        return self._calls.called_tools

    def feed(self, text: str) -> ToolCallDelta:
        out = ToolCallDelta()
        self._all += text
        if self._mode == "content":
            out.content = text
            return out
        if self._mode == "calls":
            self._calls.feed_calls(text, out)
            return out
        rest = self._all.lstrip()
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            return out  # nothing visible yet, or maybe the tag
        start = _calls_start(self._all)
        if start is None and rest.startswith(PYTHON_TAG) and not rest[len(PYTHON_TAG) :].strip():
            return out  # the tag, and what follows it not seen yet
        if start is None:
            self._mode, out.content = "content", self._all
        else:
            self._mode = "calls"
            self._calls.feed_calls(self._all[start:], out)
        return out

    def finish(self) -> ToolCallDelta:
        out = ToolCallDelta()
        if self._mode == "calls":
            self._calls.feed_calls("", out, final=True)
            if not self._calls.called_tools:
                out.content = self._all
        elif self._mode is None:
            out.content = self._all
        return out


FORMAT = ToolCallFormat(
    name="llama3_json",
    parse=parse_tool_calls,
    stream=Llama3JsonStream,
    prefix="",
    call_head='{"name": "{name}", "parameters": ',
    call_tail="}",
    separator="; ",
    suffix="",
)
