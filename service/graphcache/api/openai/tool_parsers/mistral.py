"""Mistral tool calls after the `[TOOL_CALLS]` marker (a special token: serve with special tokens kept
in the output for it to be seen), in both layouts Mistral's tokenizers have taught:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (before v11)
    [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"zone": "CET"}      (v11 and later)

What follows the marker says which: a "[" (a list of call objects) or "{" (one call object), else a
function name and its arguments object (the name may end with an `[ARGS]` marker, as v13 writes).
Arguments are the model's own JSON text; call ids are 9 letters and digits, as Mistral's templates
require of the calls a client sends back.

Text before the first marker is content (right-stripped when there are calls). The marker never
reaches content: when what follows it is not a call (not JSON, not a name and an object), that text is
content without it. After a call, everything up to the next marker is dropped. A call still open at
the end of a whole answer is a call only when the answer was cut by max_tokens (`cut`), as vLLM keeps
a v11 call cut off mid-arguments.
"""

from __future__ import annotations

import re
from typing import Any

from graphcache.api.openai.tool_parsers.base import (
    ToolCallDelta,
    ToolCallFormat,
    new_mistral_call_id,
    parse_whole,
    partial_suffix,
)
from graphcache.api.openai.tool_parsers.json_calls import Call, CallStream, NamedArguments

__all__ = ["ARGS", "FORMAT", "TOOL_CALLS", "MistralStream", "parse_tool_calls"]

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_MAX_NAME = 64  # OpenAI's limit on function names


def _name_length(text: str) -> int:
    """How many characters at the start of `text` may belong to a function name."""
    match = _NAME.match(text)
    return match.end() if match else 0


class MistralStream(CallStream):
    """Feed text deltas of one choice; get ToolCallDelta's; finish() once at the end."""

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager, new_mistral_call_id)
        # out: content | marker: after [TOOL_CALLS] | name: a v11 name | list: in "[", before an object
        # | call: in a call object | after_item: after an object in the list | done: dropping to the
        # next marker
        self._state = "out"
        self._pending = ""  # read since the marker and not decided: content (without it) if no call
        self._in_list = False
        self._list_calls = 0  # calls read from the open list
        self._call: Call | None = None

    def finish(self, cut: bool = False) -> ToolCallDelta:
        out = ToolCallDelta()
        if self._state == "out":
            self._sink.add(out, self._buf)
        elif self._state in ("marker", "name", "list"):
            self._sink.add(out, self._pending + self._buf)
        elif self._state == "call":
            assert self._call is not None
            if not self._calls.end(out, self._call, cut):
                self._reject(out)
        self._buf, self._state, self._call, self._pending = "", "out", None, ""
        self._sink.finish(out, self.called_tools)
        return out

    def _step(self, out: ToolCallDelta) -> bool:
        buf = self._buf
        state = self._state
        if state in ("out", "done"):
            i = buf.find(TOOL_CALLS)
            if i < 0:
                keep = len(buf) - partial_suffix(buf, TOOL_CALLS)
                if state == "out":
                    self._sink.add(out, buf[:keep])
                self._buf = buf[keep:]
                return False
            if state == "out":
                self._sink.add(out, buf[:i])
            self._buf, self._pending, self._state = buf[i + len(TOOL_CALLS) :], "", "marker"
        elif state == "marker":
            rest = buf.lstrip()
            self._pending += buf[: len(buf) - len(rest)]
            self._buf = rest
            if not rest:
                return False
            if rest[0] == "[":
                self._pending += "["
                self._buf, self._in_list, self._list_calls, self._state = rest[1:], True, 0, "list"
            elif rest[0] == "{":
                self._call, self._in_list, self._state = Call(), False, "call"
            elif _name_length(rest):
                self._in_list, self._state = False, "name"
            else:
                self._reject(out)
        elif state == "name":
            return self._read_name(out)
        elif state == "list":
            rest = buf.lstrip()
            self._pending += buf[: len(buf) - len(rest)]
            self._buf = rest
            if not rest:
                return False
            if rest[0] == "{":
                self._call, self._state = Call(), "call"
            elif rest[0] == "]" and not self._list_calls:  # "[]": no calls
                self._buf, self._state = rest[1:], "done"
            else:
                self._reject(out)
        elif state == "call":
            return self._read_call(out)
        else:  # after_item: "," and the next object, or the list's end
            rest = buf.lstrip()
            self._buf = rest
            if not rest:
                return False
            if rest[0] == ",":
                self._buf, self._pending, self._state = rest[1:], "", "list"
            else:
                self._state = "done"
        return True

    def _read_name(self, out: ToolCallDelta) -> bool:
        buf = self._buf
        end = _name_length(buf)
        name, rest = buf[:end], buf[end:]
        if end > _MAX_NAME:
            self._reject(out)
            return True
        if not rest or ARGS.startswith(rest):
            return False  # the name may go on, or an [ARGS] may be coming
        if rest.startswith(ARGS):
            rest = rest[len(ARGS) :]
        rest = rest.lstrip()
        if not rest:
            return False
        if rest[0] != "{":
            self._reject(out)
            return True
        self._pending += buf[: len(buf) - len(rest)]
        self._buf, self._call, self._state = rest, Call(NamedArguments(name)), "call"
        return True

    def _read_call(self, out: ToolCallDelta) -> bool:
        assert self._call is not None
        state = self._read_open_call(out, self._call)
        if state == "refused":
            self._reject(out)
        elif state == "cut":  # a stream already announced it: the call ends where its JSON broke
            self._call, self._state = None, "done"
        elif state == "closed":
            self._call, self._pending = None, ""
            self._list_calls += self._in_list
            self._state = "after_item" if self._in_list else "done"
        else:
            return False
        return True

    def _reject(self, out: ToolCallDelta) -> None:
        """What follows the marker is no call: it is content (the marker is not), and reading goes on
        after what was read of it; in a list that already held calls, the rest of it is dropped."""
        if self._in_list and self._list_calls:
            self._pending, self._call, self._state = "", None, "done"
            return
        read = self._call.reader.text if self._call is not None else ""
        self._sink.add(out, self._pending + read)
        self._pending, self._call, self._state = "", None, "out"


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer -> (content, OpenAI tool_calls). No calls: (text, []) (less any marker)."""
    return parse_whole(MistralStream(eager=False), text, cut)


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
