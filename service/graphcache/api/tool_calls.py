"""Tool calls in the Hermes format that Qwen2.5/Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline, any plain text before the first block. Three
pieces, all pure Python (no engine state):
  - `parse_tool_calls(text)`: a finished output -> (content or None, OpenAI tool_calls).
  - `ToolCallStreamParser`: text deltas -> content deltas and OpenAI streaming tool_call deltas
    (first the call's index, id, type and name, then its arguments in fragments); `<tool_call>`
    markup never reaches content.
  - `tool_choice_spec(tools, tool_choice)`: "required" or a named function become a grammar
    (engine/sample/structured.py) that forces the markup, the function name and JSON arguments matching
    the tool's `parameters` schema; "auto" and "none" constrain nothing.

Content is the text before the first block, without trailing whitespace; None when that is empty.
Text between and after blocks is dropped (it is template glue). `arguments` is the model's own JSON
text of the arguments object, so streamed fragments add up to exactly the complete parse. If any
block of a finished output is not a JSON object with a string "name" and an object "arguments"
("parameters" is accepted too), nothing is a call and the whole text is content (as vLLM does);
the streaming parser cannot take back a call it already announced, so there such a block only
ends that call's arguments early.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from graphcache.api.errors import clip
from graphcache.api.json_limits import JSONShapeError, check_json_value, parse_json_text
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import StructuredSpec

__all__ = [
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "check_history_calls",
    "check_tools",
    "parse_tool_calls",
    "tool_choice_spec",
]

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# OpenAI's rule for function names (also what keeps them safe inside a grammar literal).
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# The head of a block in the template's layout, up to where the arguments value starts.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


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
            return text, []
        calls.append(_call(*parsed))
    content = text[:start].rstrip()
    return content or None, calls


@dataclass
class ToolCallDelta:
    """What one text delta adds to a chat stream: `content` text and/or OpenAI `delta.tool_calls`
    entries ({"index", "id", "type", "function": {"name", "arguments"}} first, then
    {"index", "function": {"arguments": fragment}})."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


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
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
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
                keep = _partial_suffix(self._buf, TOOL_CALL_END)
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
        if self._scanner.done:
            return
        fresh = self._block[self._args_from + self._args_sent :]
        n = self._scanner.feed(fresh)
        if n:
            self._args_sent += n
            _add_arguments(out, self.num_calls - 1, fresh[:n])

    def _close_block(self, out: ToolCallDelta) -> None:
        if self._args_from is None:  # never announced: parse the whole block now
            parsed = _parse_block(self._block)
            if parsed is not None:
                out.tool_calls.append({"index": self.num_calls, **_call(*parsed)})
                self.num_calls += 1
        self._in_block, self._block, self._args_from, self._scanner = False, "", None, None


def _add_arguments(out: ToolCallDelta, index: int, fragment: str) -> None:
    last = out.tool_calls[-1] if out.tool_calls else None
    if last is not None and last["index"] == index:
        last["function"]["arguments"] += fragment
    else:
        out.tool_calls.append({"index": index, "function": {"arguments": fragment}})


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --- tools and tool_choice -----------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Validate OpenAI `tools` ([{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]); returns name -> parameters schema. InvalidRequest(param "tools") otherwise."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of function tools", param="tools")
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise InvalidRequest(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', param="tools"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise InvalidRequest(
                f"tools[{i}].function.name must match ^[A-Za-z0-9_-]{{1,64}}$, got {clip(repr(name))}",
                param="tools",
            )
        if name in schemas:
            raise InvalidRequest(
                f"tools[{i}]: function {name!r} is defined twice; give each tool a unique name", param="tools"
            )
        try:  # the template renders the whole tool and the grammar embeds its schema: both recurse
            check_json_value(tool)
        except JSONShapeError as e:
            raise InvalidRequest(f"tools[{i}] {e}", param="tools") from None
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be a JSON schema object", param="tools"
            )
        schemas[name] = params
    return schemas


def check_history_calls(calls: list[Any]) -> list[Any]:
    """An assistant message's earlier `tool_calls` as the chat template needs them: each
    {"function": {"name": str, "arguments": a JSON object, or its JSON text}}, not nested past
    MAX_JSON_DEPTH, valid Unicode throughout. ValueError naming the call otherwise (pydantic turns it
    into a 400 on messages[i].tool_calls)."""
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(
                f'tool_calls[{i}] must be {{"type": "function", "function": {{"name": ..., '
                '"arguments": ...}}'
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tool_calls[{i}].function.name must be a non-empty string")
        args = fn.get("arguments")
        try:
            check_json_value(call)
            parsed = parse_json_text(args) if isinstance(args, str) and args.strip() else args
        except JSONShapeError as e:
            raise ValueError(f"tool_calls[{i}] {e}") from None
        except ValueError:
            parsed = None  # not JSON: refused below
        if not (isinstance(parsed, dict) or args is None or (isinstance(args, str) and not args.strip())):
            raise ValueError(
                f"tool_calls[{i}].function.arguments must be a JSON object (as a string), "
                "as the model produced it"
            )
    return calls


def tool_choice_spec(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool = True
) -> StructuredSpec | None:
    """The constraint that enforces `tool_choice`: None for "auto"/"none"/unset; for "required" a
    grammar of one or more calls (exactly one when parallel_tool_calls is False) to any listed tool;
    for {"type": "function", "function": {"name": N}} exactly one call of N. The grammar is Lark with
    llguidance's `%json` rules for the arguments; compile it with StructuredOutput.check(spec,
    param="tools") to reject a parameters schema the engine cannot use."""
    schemas = check_tools(tools)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        if not schemas:
            raise InvalidRequest('tool_choice "required" needs a non-empty tools list', param="tool_choice")
        return StructuredSpec("grammar", _calls_grammar(schemas, many=parallel_tool_calls))
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in schemas:
        listed = clip(", ".join(schemas) or "none", 256)
        raise InvalidRequest(
            f"tool_choice names function {clip(repr(name))}, which is not in tools (listed: {listed})",
            param="tool_choice",
        )
    return StructuredSpec("grammar", _calls_grammar({name: schemas[name]}, many=False))


def _calls_grammar(schemas: dict[str, dict[str, Any]], many: bool) -> str:
    """Lark: the template's exact markup, with each tool's arguments a `%json` rule of its schema."""
    lines = [
        'start: call ("\\n" call)*' if many else "start: call",
        "call: " + " | ".join(f"call_{i}" for i in range(len(schemas))),
    ]
    for i, (name, params) in enumerate(schemas.items()):
        head = TOOL_CALL_START + '\n{"name": "' + name + '", "arguments": '
        lines.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + chr(10) + TOOL_CALL_END)}")
        lines.append(f"args_{i}: %json {json.dumps(params)}")
    return "\n".join(lines) + "\n"
