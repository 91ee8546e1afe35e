"""What every tool-call parser gives (one module per model family beside this one, chosen by the
`tool_call_parser` setting): a finished output's calls, a streaming parser, and the call markup a
tool_choice grammar forces. Calls are OpenAI's: {"id", "type": "function", "function": {"name",
"arguments": JSON text}}; stream deltas first carry a call's index, id, type and name, then fragments
of its arguments."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallStream",
    "add_arguments",
    "new_call",
    "new_call_id",
    "partial_suffix",
]


@dataclass
class ToolCallDelta:
    """What one text delta adds to a chat stream: `content` text and/or OpenAI `delta.tool_calls`
    entries ({"index", "id", "type", "function": {"name", "arguments"}} first, then
    {"index", "function": {"arguments": fragment}})."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream(Protocol):
    """One choice's streaming parser: feed() each text delta, finish() once at the end."""

    @property
    def num_calls(self) -> int: ...

    @property
    def called_tools(self) -> bool: ...

    def feed(self, text: str) -> ToolCallDelta: ...

    def finish(self) -> ToolCallDelta: ...


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call format. The grammar of tool_choice "required" is
    prefix call (separator call)* suffix, each call `call_head` (with {name} filled in) + the
    arguments object + `call_tail`."""

    name: str
    parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]]
    stream: Callable[[], ToolCallStream]
    prefix: str
    call_head: str
    call_tail: str
    separator: str
    suffix: str

    def head(self, function_name: str) -> str:
        return self.call_head.replace("{name}", function_name)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def new_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def add_arguments(out: ToolCallDelta, index: int, fragment: str) -> None:
    """Append an arguments fragment of call `index` to `out` (joining its last entry for that call)."""
    last = out.tool_calls[-1] if out.tool_calls else None
    if last is not None and last["index"] == index:
        last["function"]["arguments"] += fragment
    else:
        out.tool_calls.append({"index": index, "function": {"arguments": fragment}})


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
