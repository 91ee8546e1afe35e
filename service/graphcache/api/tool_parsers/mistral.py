"""Mistral tool calls, as Mistral's chat templates ask for them:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

one JSON list of calls after the `[TOOL_CALLS]` marker (a special token: serve with special tokens kept
in the output for it to be seen), any text before the marker is content. A last call cut off by
max_tokens is dropped and the complete calls before it kept; any other element that is not a call
{"name", "arguments"} makes the whole answer content, as vLLM's mistral parser reads it.
"""

from __future__ import annotations

import json
from typing import Any

from graphcache.api.tool_parsers.base import ToolCallDelta, ToolCallFormat, new_call, partial_suffix
from graphcache.api.tool_parsers.json_calls import JsonCallsStream, call_of, read_partial

__all__ = ["FORMAT", "TOOL_CALLS", "MistralStream", "parse_tool_calls", "read_calls"]

TOOL_CALLS = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


def read_calls(text: str) -> tuple[list[Any], int]:
    """The list after the marker (a lone object is taken as a list of one): (objects, complete)."""
    body = text.lstrip()
    try:
        value, _ = _DECODER.raw_decode(body)
        complete = True
    except (json.JSONDecodeError, RecursionError):
        value, complete = read_partial(body), False
    if value is None:
        return [], 0
    calls = value if isinstance(value, list) else [value]
    return calls, len(calls) if complete else len(calls) - 1


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    objects, complete = read_calls(text[start + len(TOOL_CALLS) :])
    parsed = [call_of(obj) for obj in objects[:complete]]
    if not parsed or any(p is None for p in parsed):
        return text, []
    return text[:start].rstrip() or None, [new_call(*p) for p in parsed if p is not None]


class MistralStream:
    """Content until `[TOOL_CALLS]` (a tail that may be the start of the marker, and trailing
    whitespace, held until the next delta), then the calls."""

    def __init__(self) -> None:
        self._buf = ""
        self._held_ws = ""
        self._after = ""  # the marker and what followed: the content if no call comes of it
        self._in_calls = False
        self._calls = JsonCallsStream(read_calls)

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls

    @property
    def called_tools(self) -> bool:
        return self._calls.called_tools

    def feed(self, text: str) -> ToolCallDelta:
        out = ToolCallDelta()
        if self._in_calls:
            self._after += text
            self._calls.feed_calls(text, out)
            return out
        self._buf += text
        i = self._buf.find(TOOL_CALLS)
        if i < 0:
            keep = partial_suffix(self._buf, TOOL_CALLS)
            self._content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out
        out.content += (self._held_ws + self._buf[:i]).rstrip()
        self._in_calls, self._after = True, self._buf[i:]
        self._calls.feed_calls(self._buf[i + len(TOOL_CALLS) :], out)
        return out

    def _content(self, out: ToolCallDelta, text: str) -> None:
        text = self._held_ws + text
        body = text.rstrip()
        out.content += body
        self._held_ws = text[len(body) :]

    def finish(self) -> ToolCallDelta:
        out = ToolCallDelta()
        if self._in_calls:
            self._calls.feed_calls("", out, final=True)
            if not self._calls.called_tools:
                out.content = self._after
        else:
            out.content = self._held_ws + self._buf
        return out


FORMAT = ToolCallFormat(
    name="mistral",
    parse=parse_tool_calls,
    stream=MistralStream,
    prefix=TOOL_CALLS + " [",
    call_head='{"name": "{name}", "arguments": ',
    call_tail="}",
    separator=", ",
    suffix="]",
)
