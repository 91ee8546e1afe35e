"""Hermes tool calls, as the Qwen2.5/Qwen3, Hermes and Granite 4 chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. The object's keys may come in any order; "parameters" is read as "arguments", and
arguments given as a JSON string holding the object (Granite 4) are that object. A call's arguments are
the model's own JSON text, so streamed fragments add up to exactly the whole answer's.
  - `parse_tool_calls(text, cut=False)`: a whole answer -> (content, OpenAI tool_calls).
  - `ToolCallStreamParser`: text deltas -> content deltas and OpenAI streaming tool_call deltas (a call
    is announced once its name is complete and its arguments have begun, then its arguments follow).

Content is the text outside the blocks as written (right-stripped when there are calls; None if
nothing is left). A block that is not a call (not a JSON object with a string "name" and object
arguments, JSON broken before the call was announced, or nested past MAX_JSON_DEPTH) is content,
markup and all; the other blocks stay calls. A block whose object is still open at the end of a whole
answer is a call only when the answer was cut by max_tokens (`cut`); a model that stopped there wrote a
broken block. Text after a call's object and before `</tool_call>` is dropped; a `<tool_call>` there
starts the next block (a model that forgot the closing tag).
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

__all__ = ["FORMAT", "TOOL_CALL_END", "TOOL_CALL_START", "ToolCallStreamParser", "parse_tool_calls"]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class ToolCallStreamParser(CallStream):
    """Feed text deltas of one choice; get ToolCallDelta's; finish() once at the end. `eager=False`
    decides each call when its object closes (parse_tool_calls)."""

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager, new_call_id)
        self._state = "out"  # out | block (before its object) | call (in its object) | after
        self._raw = ""  # the open block's markup: "<tool_call>" and the whitespace after it
        self._call: Call | None = None

    def finish(self, cut: bool = False) -> ToolCallDelta:
        """End of the answer: flush held content; a block still open is a call if a stream announced
        it or the answer was `cut` by max_tokens, else content."""
        out = ToolCallDelta()
        if self._state == "out":
            self._sink.add(out, self._buf)
        elif self._state == "block":
            self._sink.add(out, self._raw + self._buf)
        elif self._state == "call":
            assert self._call is not None
            if not self._calls.end(out, self._call, cut):
                self._reject(out)
        self._buf, self._state, self._call = "", "out", None
        self._sink.finish(out, self.called_tools)
        return out

    def _step(self, out: ToolCallDelta) -> bool:
        """Consume what the state allows; False when more text is needed."""
        buf = self._buf
        if self._state == "out":
            i = buf.find(TOOL_CALL_START)
            if i < 0:
                keep = len(buf) - partial_suffix(buf, TOOL_CALL_START)
                self._sink.add(out, buf[:keep])
                self._buf = buf[keep:]
                return False
            self._sink.add(out, buf[:i])
            self._buf, self._raw, self._state = buf[i + len(TOOL_CALL_START) :], TOOL_CALL_START, "block"
        elif self._state == "block":
            rest = buf.lstrip()
            self._raw += buf[: len(buf) - len(rest)]
            self._buf = rest
            if not rest:
                return False
            if rest[0] == "{":
                self._call, self._state = Call(), "call"
            else:
                self._reject(out)
        elif self._state == "call":
            assert self._call is not None
            state = self._read_open_call(out, self._call)
            if state == "refused":
                self._reject(out)
            elif state == "open":
                return False
            else:  # closed, or cut (a stream already announced it: the call ends where its JSON broke)
                self._state = "after"
        else:  # after a call's object: skip to the block's end, or to the next block
            end, start = buf.find(TOOL_CALL_END), buf.find(TOOL_CALL_START)
            if start >= 0 and (end < 0 or start < end):
                self._buf, self._state = buf[start:], "out"
            elif end >= 0:
                self._buf, self._state = buf[end + len(TOOL_CALL_END) :], "out"
            else:
                keep = max(partial_suffix(buf, TOOL_CALL_END), partial_suffix(buf, TOOL_CALL_START))
                self._buf = buf[len(buf) - keep :]
                return False
        return True

    def _reject(self, out: ToolCallDelta) -> None:
        """The open block is no call: its text so far is content, and reading goes on after it."""
        read = self._call.reader.text if self._call is not None else ""
        self._sink.add(out, self._raw + read)
        self._raw, self._call, self._state = "", None, "out"


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer -> (content, OpenAI tool_calls: id, type "function", function {name, arguments
    as JSON text}). No calls: (text, []). `cut`: the answer was cut by max_tokens."""
    return parse_whole(ToolCallStreamParser(eager=False), text, cut)


FORMAT = ToolCallFormat(
    name="hermes",
    parse=parse_tool_calls,
    stream=ToolCallStreamParser,
    prefix="",
    call_head=TOOL_CALL_START + '\n{"name": "{name}", "arguments": ',
    call_tail="}\n" + TOOL_CALL_END,
    separator="\n",
    suffix="",
)
