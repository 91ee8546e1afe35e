"""Hermes tool calls, as the Qwen2.5/Qwen3 and Hermes chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline, any plain text before the first block.
  - `parse_tool_calls(text)`: a finished output -> (content or None, OpenAI tool_calls).
  - `ToolCallStreamParser`: text deltas -> content deltas and OpenAI streaming tool_call deltas
    (first the call's index, id, type and name, then its arguments in fragments); `<tool_call>`
    markup never reaches content.

Content is the text before the first block, without trailing whitespace; None when that is empty.
Text between and after blocks is dropped (it is template glue). `arguments` is the model's own JSON
text of the arguments object, so streamed fragments add up to exactly the complete parse. A last
block that never closed (the output was cut by max_tokens) and is not a valid call is dropped, and
the complete calls before it are kept. If any other block is not a JSON object with a string "name"
and an object "arguments" ("parameters" is accepted too), nothing is a call and the whole text is
content (as vLLM does); the streaming parser cannot take back a call it already announced, so there
such a block only ends that call's arguments early. Arguments are streamed by a small string-aware
brace scanner rather than partial-json-parser: the raw text passes through unchanged, so streamed
and complete arguments are the same bytes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from graphcache.api.tool_parsers.base import (
    ToolCallDelta,
    ToolCallFormat,
    add_arguments,
    new_call,
    new_call_id,
    partial_suffix,
)

__all__ = ["FORMAT", "TOOL_CALL_END", "TOOL_CALL_START", "ToolCallStreamParser", "parse_tool_calls"]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# The head of a block in the template's layout, up to where the arguments value starts.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)


def _parse_block(body: str) -> tuple[str, str] | None:
    """(name, raw arguments JSON) of one block's body, or None if it is not a valid call (a body
    nested past the interpreter's recursion limit, as an unconstrained or endlessly recursive schema
    lets a model write, is not a call either: the text stays content)."""
    try:
        return _parse_json_block(body)
    except (json.JSONDecodeError, RecursionError):
        return None


def _parse_json_block(body: str) -> tuple[str, str] | None:
    obj = json.loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if not isinstance(args, dict):
        return None
    head = _HEAD.match(body)
    if head is not None:  # the template's layout: keep the model's own arguments text
        raw, end = json.JSONDecoder().raw_decode(body, head.end())
        if raw == args:
            return obj["name"], body[head.end() : end]
    return obj["name"], json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished output -> (content or None, OpenAI tool_calls: id, type "function", function
    {name, arguments as a JSON string}). No valid calls: (text, [])."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for match in _BLOCK.finditer(text, start):
        parsed = _parse_block(match.group(1))
        if parsed is None:
            if match.end() == len(text) and not match.group(0).endswith(TOOL_CALL_END):
                break  # the last block, cut off before it closed: keep the calls before it
            return text, []
        calls.append(new_call(*parsed))
    if not calls:
        return text, []
    content = text[:start].rstrip()
    return content or None, calls


class _ValueScanner:
    """Finds where a JSON value that starts with "{" ends, one character at a time (string-aware)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How many chars of `text` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallStreamParser:
    """Feed text deltas of one choice; get ToolCallDelta's. Call finish() at the end of the stream.

    Before the first `<tool_call>`, text is content, minus a tail that may be the start of the tag
    or trailing whitespace (held until the next delta shows what it is). Inside a block in the
    template's layout the call is announced as soon as its name is complete and its arguments
    stream as they arrive; a block in another layout is parsed whole at its `</tool_call>`."""

    def __init__(self) -> None:
        self._buf = ""  # text not consumed yet
        self._in_block = False
        self._block = ""  # the current block's body so far (no markup)
        self._args_from: int | None = None  # where the arguments value starts in _block (announced)
        self._args_sent = 0  # chars of the arguments value already sent
        self._scanner: _ValueScanner | None = None
        self._seen_call = False
        self._held_ws = ""  # trailing whitespace of content: sent only if more content follows
        self.num_calls = 0

    @property
    def called_tools(self) -> bool:
        """True once a call was announced: the choice's finish_reason becomes "tool_calls"."""
        return self.num_calls > 0

    def feed(self, text: str) -> ToolCallDelta:
        self._buf += text
        out = ToolCallDelta()
        while True:
            if not self._in_block:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = partial_suffix(self._buf, TOOL_CALL_START)
                    self._emit_content(out, self._buf[: len(self._buf) - keep], final=False)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit_content(out, self._buf[:i], final=False, before_call=True)
                self._buf = self._buf[i + len(TOOL_CALL_START) :]
                self._in_block, self._block = True, ""
                self._seen_call = True
                continue
            j = self._buf.find(TOOL_CALL_END)
            if j < 0:  # still inside: take all but a possible partial closing tag
                keep = partial_suffix(self._buf, TOOL_CALL_END)
                self._block += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                self._advance_block(out)
                return out
            self._block += self._buf[:j]
            self._buf = self._buf[j + len(TOOL_CALL_END) :]
            self._advance_block(out)
            self._close_block(out)

    def finish(self) -> ToolCallDelta:
        """End of stream: flush held content, or close an unterminated last block."""
        out = ToolCallDelta()
        if self._in_block:
            self._block += self._buf
            self._advance_block(out)
            self._close_block(out)
        else:
            self._emit_content(out, self._buf, final=True)
        self._buf = ""
        return out

    # --- internals -------------------------------------------------------------------------
    def _emit_content(self, out: ToolCallDelta, text: str, final: bool, before_call: bool = False) -> None:
        if self._seen_call or not text and not final:
            return  # after the first call, text outside blocks is dropped (as in parse_tool_calls)
        text = self._held_ws + text
        if before_call:
            out.content += text.rstrip()
            self._held_ws = ""
            return
        if final:
            out.content += text
            self._held_ws = ""
            return
        body = text.rstrip()
        out.content += body
        self._held_ws = text[len(body) :]

    def _advance_block(self, out: ToolCallDelta) -> None:
        if self._args_from is None:
            head = _HEAD.match(self._block)
            if head is None or not self._block[head.end() :].lstrip()[:1]:
                return
            if not self._block[head.end() :].startswith("{"):
                return  # not the template's layout: parsed whole at the close
            self._args_from, self._args_sent = head.end(), 0
            self._scanner = _ValueScanner()
            out.tool_calls.append(
                {
                    "index": self.num_calls,
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": head.group(1), "arguments": ""},
                }
            )
            self.num_calls += 1
        assert self._scanner is not None  # set with _args_from
        if self._scanner.done:
            return
        fresh = self._block[self._args_from + self._args_sent :]
        n = self._scanner.feed(fresh)
        if n:
            self._args_sent += n
            add_arguments(out, self.num_calls - 1, fresh[:n])

    def _close_block(self, out: ToolCallDelta) -> None:
        if self._args_from is None:  # never announced: parse the whole block now
            parsed = _parse_block(self._block)
            if parsed is not None:
                out.tool_calls.append({"index": self.num_calls, **new_call(*parsed)})
                self.num_calls += 1
        self._in_block, self._block, self._args_from, self._scanner = False, "", None, None


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
