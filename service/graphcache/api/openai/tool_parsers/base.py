"""What every tool-call parser gives (one module per model family beside this one, chosen by the
`tool_call_parser` setting): a finished output's calls, a streaming parser, and the call markup a
tool_choice grammar forces. Calls are OpenAI's: {"id", "type": "function", "function": {"name",
"arguments": JSON text}}; stream deltas first carry a call's index, id, type and complete name, then
fragments of its arguments.

Each family has one state machine, run in two modes: a stream (`eager`: a call is announced as soon
as its name is complete and its arguments have begun, and its arguments follow as they arrive) and a
whole answer (`parse_whole`: the same machine over the whole text, deciding each call when its object
closes). So a whole answer and any chunking of its stream give the same content and calls; they differ
only where a call's JSON breaks after the stream announced it (a stream cannot take a call back).

Content is the text outside the calls, as the model wrote it; when there are calls, its trailing
whitespace is dropped (and all-whitespace content is None), so a stream holds trailing whitespace back
until more text follows it."""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ContentSink",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallStream",
    "add_arguments",
    "new_call",
    "new_call_id",
    "new_mistral_call_id",
    "parse_whole",
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

    def finish(self, cut: bool = False) -> ToolCallDelta: ...


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call format. The grammar of tool_choice "required" is
    prefix call (separator call)* suffix, each call `call_head` (with {name} filled in) + the
    arguments object + `call_tail`."""

    name: str
    parse: Callable[..., tuple[str | None, list[dict[str, Any]]]]  # (text, cut=False)
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


_ALNUM = string.ascii_letters + string.digits


def new_mistral_call_id() -> str:
    """Mistral's templates and mistral_common refuse a history call whose id is not 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


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


class ContentSink:
    """The content a parser lets through: trailing whitespace is held until more text follows it, and
    at the end sent only when there were no calls (content with calls is right-stripped)."""

    def __init__(self) -> None:
        self._held = ""

    def add(self, out: ToolCallDelta, text: str) -> None:
        if not text:
            return
        text = self._held + text
        body = text.rstrip()
        out.content += body
        self._held = text[len(body) :]

    def finish(self, out: ToolCallDelta, called: bool) -> None:
        if not called:
            out.content += self._held
        self._held = ""


def parse_whole(stream: ToolCallStream, text: str, cut: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer through a family's machine (made with eager=False): (content, calls). No calls:
    (content, []) with the content as it is; calls: (content or None, calls). `cut`: the answer was cut
    by max_tokens, so a call still open at its end is kept with the arguments it had."""
    first, last = stream.feed(text), stream.finish(cut)
    calls: list[dict[str, Any]] = []
    for entry in first.tool_calls + last.tool_calls:
        if "id" in entry:
            calls.append(new_call(entry["function"]["name"], entry["function"]["arguments"], entry["id"]))
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    content = first.content + last.content
    return (content or None, calls) if calls else (content, [])
