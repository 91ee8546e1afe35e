"""Llama 3.1-3.3 JSON tool calls, as Meta's tool-calling chat template asks for them:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

a JSON object per call, several separated by ";" (the `<|python_tag|>` is optional, and only visible
when special tokens are kept). "arguments" is read as "parameters", the keys may come in any order,
and arguments are the model's own JSON text.

As in vLLM, a call may stand anywhere in the answer: every "{" outside a call starts a candidate
object, read until it is a call (its name complete and its arguments begun, in a stream) or shown not
to be one (not JSON, or a complete object that is not a call: then it is content, and the braces
inside it start nothing). Unlike vLLM, the prose around calls stays content: a stream has sent the
prose before a call by the time the call shows up. The ";" and whitespace after a call, and a python
tag right before one, are markup and dropped. A candidate still open at the end of a whole answer is
a call only when the answer was cut by max_tokens (`cut`).
"""

from __future__ import annotations

from typing import Any

from graphcache.api.openai.tool_parsers.base import (
    ToolCallDelta,
    ToolCallFormat,
    new_call_id,
    parse_whole,
    partial_suffix,
)
from graphcache.api.openai.tool_parsers.json_calls import Call, CallStream

__all__ = ["FORMAT", "PYTHON_TAG", "Llama3JsonStream", "parse_tool_calls"]

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\n\r;"


class Llama3JsonStream(CallStream):
    """Feed text deltas of one choice; get ToolCallDelta's; finish() once at the end."""

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager, new_call_id)
        self._state = "out"  # out | tag (python tag read) | call | sep (after a call) | skip
        self._glue = ""  # a python tag (and whitespace) before the candidate: content if no call
        self._call: Call | None = None

    def finish(self, cut: bool = False) -> ToolCallDelta:
        out = ToolCallDelta()
        if self._state in ("out", "sep"):
            self._sink.add(out, self._buf)
        elif self._state == "tag":
            self._sink.add(out, self._glue + self._buf)
        elif self._state == "call":
            assert self._call is not None
            if not self._calls.end(out, self._call, cut):
                self._reject(out)
        self._buf, self._state, self._call, self._glue = "", "out", None, ""
        self._sink.finish(out, self.called_tools)
        return out

    def _step(self, out: ToolCallDelta) -> bool:
        buf = self._buf
        if self._state == "out":
            brace, tag = buf.find("{"), buf.find(PYTHON_TAG)
            if brace < 0 and tag < 0:
                keep = len(buf) - partial_suffix(buf, PYTHON_TAG)
                self._sink.add(out, buf[:keep])
                self._buf = buf[keep:]
                return False
            if tag >= 0 and (brace < 0 or tag < brace):
                self._sink.add(out, buf[:tag])
                self._buf, self._glue, self._state = buf[tag + len(PYTHON_TAG) :], PYTHON_TAG, "tag"
            else:
                self._sink.add(out, buf[:brace])
                self._buf, self._glue, self._call, self._state = buf[brace:], "", Call(), "call"
        elif self._state == "tag":
            rest = buf.lstrip()
            self._glue += buf[: len(buf) - len(rest)]
            self._buf = rest
            if not rest:
                return False
            if rest[0] == "{":
                self._call, self._state = Call(), "call"
            else:
                self._sink.add(out, self._glue)
                self._glue, self._state = "", "out"
        elif self._state == "call":
            assert self._call is not None
            state = self._read_open_call(out, self._call)
            if state == "refused":
                self._reject(out)
            elif state == "cut":  # a stream already announced it: what follows its broken JSON is dropped
                self._state = "skip"
            elif state == "closed":
                self._call, self._glue, self._state = None, "", "sep"
            else:
                return False
        elif self._state == "sep":
            rest = buf.lstrip(_SEPARATORS)
            self._buf = rest
            if not rest or PYTHON_TAG.startswith(rest):
                return False
            if rest[0] == "{":
                self._call, self._state = Call(), "call"
            elif rest.startswith(PYTHON_TAG):
                self._buf, self._glue, self._state = rest[len(PYTHON_TAG) :], PYTHON_TAG, "tag"
            else:
                self._state = "out"
        else:
            self._buf = ""
            return False
        return True

    def _reject(self, out: ToolCallDelta) -> None:
        """The candidate is no call: its text is content. A complete object goes whole (its inner
        braces start nothing); JSON that broke goes up to where it broke, and reading goes on there."""
        assert self._call is not None
        self._sink.add(out, self._glue + self._call.reader.text)
        self._glue, self._call, self._state = "", None, "out"


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer -> (content, OpenAI tool_calls). No calls: (text, [])."""
    return parse_whole(Llama3JsonStream(eager=False), text, cut)


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
