"""A generation request's tools and output constraint, checked and compiled before anything is submitted.

Tools (OpenAI function tools) reach the chat template as plain dicts, checked (`template_tools`);
tool_choice "required" or a named function becomes a grammar forcing the call markup
(`forced_tool_spec`, api/openai/tool_calls.py); the output constraint is that grammar or the body's
structured-output field (`output_constraint`, constraints.py), compiled off the event loop
(`check_constraint`) so an invalid schema, regex or grammar is a 400 naming the field it came in.
"""

from __future__ import annotations

import asyncio
from typing import Any

from graphcache.api.openai import constraints, tool_calls
from graphcache.api.openai.protocol import ChatCompletionRequest
from graphcache.api.openai.tool_parsers import tool_call_format
from graphcache.api.server.errors import api_error_for
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import StructuredSpec


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` as the chat template gets them, checked (a 400 naming "tools" otherwise): plain dicts
    without null fields at the tool and function level (a template would print them as "None")."""
    if not tools:
        return None
    try:
        tool_calls.check_tools(tools)
    except InvalidRequest as e:
        raise api_error_for(e) from None
    out = []
    for tool in tools:
        fn = {k: v for k, v in tool["function"].items() if v is not None}
        out.append({**{k: v for k, v in tool.items() if v is not None}, "function": fn})
    return out


def forced_tool_spec(body: ChatCompletionRequest, tool_call_parser: str = "hermes") -> StructuredSpec | None:
    """The constraint tool_choice puts on the output: "required" or a named function force the call
    markup (api/openai/tool_calls.py); "auto", "none" or no tools constrain nothing."""
    if not body.tools_active:
        return None
    try:
        return tool_calls.tool_choice_spec(
            body.tools, body.tool_choice, body.parallel_tool_calls, tool_call_format(tool_call_parser)
        )
    except InvalidRequest as e:
        raise api_error_for(e) from None


def output_constraint(
    body, tool_spec: StructuredSpec | None = None, compact_default: bool = False
) -> tuple[StructuredSpec, str] | None:
    """The output constraint and the field the client set it with (a tool_choice's grammar holds the
    tools' parameter schemas: "tools"). The body's check() already refused two constraints at once.
    JSON is compact as the request's disable_any_whitespace says, else as the server's default."""
    if tool_spec is not None:
        return tool_spec, "tools"
    try:
        found = body.structured_constraints()
        own = constraints.disable_any_whitespace(body.structured_outputs)
    except InvalidRequest as e:
        raise api_error_for(e) from None
    if not found:
        return None
    param, kind, value = found[0]
    compact = (compact_default if own is None else own) and kind in constraints.JSON_KINDS
    return StructuredSpec(kind, value, compact), param


def _compile(engine, spec: StructuredSpec, param: str) -> None:
    checker = engine.checker
    if checker is None:  # the engine stopped meanwhile: generate() refuses the request
        return
    checker.structured.check(spec, param)  # the compiler is built once, under the checker's lock


async def check_constraint(engine, constraint: tuple[StructuredSpec, str] | None) -> None:
    """Compile the constraint off the event loop (a large schema takes ~100 ms; the compiler's first
    build ~1 s): an invalid schema, regex or grammar is a 400 naming the field the client used. The
    compiled grammar is cached, so the engine's own check at submit is a cache hit."""
    if constraint is None:
        return
    try:  # grammar compiling's own bounded pool belongs in api/server/executors.py, beside run_input/run_response
        await asyncio.to_thread(_compile, engine, *constraint)
    except InvalidRequest as e:
        raise api_error_for(e) from None
