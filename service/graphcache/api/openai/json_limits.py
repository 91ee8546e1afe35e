"""Bounds on the JSON values a client nests inside a request (tools, earlier tool calls).

The request body itself is parsed by FastAPI, but what is inside it is walked again later: the chat
template renders tools and tool-call arguments with `tojson`, arguments sent as a JSON string are
parsed, and a tool-call grammar embeds the parameter schemas. Each of those recurses once per
nesting level, and Python's recursion limit (1000 frames, shared with the template engine's own
frames) makes a value nested some hundreds deep a RecursionError deep inside a library: a 500 for
what is the client's input. So values are checked here first, without recursion, and a value that
is too deep, or holds a string that is not valid Unicode (a lone surrogate, which JSON can carry but
UTF-8 cannot), is the client's 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_JSON_DEPTH", "JSONShapeError", "check_json_value", "parse_json_text"]

# Far deeper than any real tool schema or arguments object (OpenAI's own limit for schemas is 10
# levels), and far below the depth at which rendering or parsing would exhaust Python's stack.
MAX_JSON_DEPTH = 64


class JSONShapeError(ValueError):
    """The value is too deep or holds invalid Unicode; the message names the rule, never the value."""


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise JSONShapeError("contains invalid Unicode (a lone surrogate); send valid UTF-8") from None


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise JSONShapeError when `value` (dicts, lists, scalars) nests deeper than `max_depth`
    containers or holds a string (a key too) with a lone surrogate. Iterative: no depth can make it
    recurse."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                raise JSONShapeError(f"is nested deeper than {max_depth} levels; flatten it")
            if isinstance(item, dict):
                for key, child in item.items():
                    if isinstance(key, str):
                        _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def parse_json_text(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads(text), refused (JSONShapeError) when nested deeper than `max_depth` or holding a lone
    surrogate; ValueError (json.JSONDecodeError) when it is not JSON."""
    _check_text(text)
    try:
        value = json.loads(text)
    except RecursionError:  # the C parser guards its own stack: nesting past the interpreter's limit
        raise JSONShapeError(f"is nested deeper than {max_depth} levels; flatten it") from None
    check_json_value(value, max_depth)  # "\ud800" escapes decode to lone surrogates
    return value
