"""OpenAI function tools: checking `tools` and history calls, and the grammar tool_choice forces.

  - `check_tools(tools)`, `check_history_calls(calls)`: the request's tools and an assistant message's
    earlier calls, validated (a 400 naming the field otherwise).
  - `tool_choice_spec(tools, tool_choice, parallel, fmt)`: "required" or a named function become a
    grammar (engine/sample/structured.py) that forces the call markup of the served model's family
    (`fmt`, api/openai/tool_parsers/), the function name and JSON arguments matching the tool's `parameters`
    schema; "auto" and "none" constrain nothing.

Reading calls back out of an answer is the tool parsers' work (api/openai/tool_parsers/, chosen by the
`tool_call_parser` setting); the Hermes parser's names are re-exported here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from graphcache.api.openai.json_limits import JSONShapeError, check_json_value, parse_json_text
from graphcache.api.openai.tool_parsers import ToolCallFormat, tool_call_format
from graphcache.api.openai.tool_parsers.base import ToolCallDelta
from graphcache.api.openai.tool_parsers.hermes import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCallStreamParser,
    parse_tool_calls,
)
from graphcache.api.server.errors import clip
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

# OpenAI's rule for function names (also what keeps them safe inside a grammar literal).
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


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
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool = True,
    fmt: ToolCallFormat | None = None,
) -> StructuredSpec | None:
    """The constraint that enforces `tool_choice`: None for "auto"/"none"/unset; for "required" a
    grammar of one or more calls (exactly one when parallel_tool_calls is False) to any listed tool;
    for {"type": "function", "function": {"name": N}} exactly one call of N. The grammar is Lark with
    llguidance's `%json` rules for the arguments; compile it with StructuredOutput.check(spec,
    param="tools") to reject a parameters schema the engine cannot use."""
    fmt = fmt or tool_call_format("hermes")
    schemas = check_tools(tools)
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        if not schemas:
            raise InvalidRequest('tool_choice "required" needs a non-empty tools list', param="tool_choice")
        return StructuredSpec("grammar", _calls_grammar(fmt, schemas, many=parallel_tool_calls))
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
    return StructuredSpec("grammar", _calls_grammar(fmt, {name: schemas[name]}, many=False))


def _calls_grammar(fmt: ToolCallFormat, schemas: dict[str, dict[str, Any]], many: bool) -> str:
    """Lark: the parser's exact call markup, with each tool's arguments a `%json` rule of its schema."""
    calls = f"call ({json.dumps(fmt.separator)} call)*" if many else "call"
    start = " ".join(
        json.dumps(part) if part is not calls else part for part in (fmt.prefix, calls, fmt.suffix) if part
    )
    lines = ["start: " + start, "call: " + " | ".join(f"call_{i}" for i in range(len(schemas)))]
    for i, (name, params) in enumerate(schemas.items()):
        lines.append(f"call_{i}: {json.dumps(fmt.head(name))} args_{i} {json.dumps(fmt.call_tail)}")
        lines.append(f"args_{i}: %json {json.dumps(params)}")
    return "\n".join(lines) + "\n"
