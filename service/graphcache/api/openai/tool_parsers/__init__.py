"""Tool-call parsers, one module per model family, all behind `ToolCallFormat` (base.py); the
`tool_call_parser` setting picks one with `tool_call_format(name)`."""

from __future__ import annotations

from graphcache.api.openai.tool_parsers import hermes, llama3_json, mistral
from graphcache.api.openai.tool_parsers.base import ToolCallDelta, ToolCallFormat, ToolCallStream
from graphcache.choices import TOOL_CALL_PARSERS

__all__ = ["ToolCallDelta", "ToolCallFormat", "ToolCallStream", "tool_call_format"]

_FORMATS = {f.name: f for f in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT)}
assert set(_FORMATS) == set(TOOL_CALL_PARSERS), "every tool_call_parser choice has a module"


def tool_call_format(name: str) -> ToolCallFormat:
    return _FORMATS[name]
