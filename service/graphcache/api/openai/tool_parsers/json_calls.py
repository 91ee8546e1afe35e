"""What the families share between reading a call's JSON (json_scan.py) and the deltas a client gets:
when a call is announced, and which of its arguments text goes out.

A `Call` wraps the reader of one call object. In a stream (`eager`) it is announced once the reader is
`ready` (its name complete, its arguments begun) and its arguments then go out as they are read; in a
whole answer it is decided when its object closes (a call if it is ready then), or at the end of the
text when the answer was cut by max_tokens. Arguments are the model's own text, so what a stream sent
adds up to exactly the whole answer's arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

from graphcache.api.openai.tool_parsers.base import ContentSink, ToolCallDelta, add_arguments
from graphcache.api.openai.tool_parsers.json_scan import CallObject, ScannedObject

__all__ = ["Call", "CallState", "Calls", "NamedArguments", "Reader"]


CallState = Literal["open", "closed", "cut", "refused"]  # CallStream._read_open_call's answer


class Reader(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def done(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    def feed(self, piece: str) -> int: ...

    def name(self) -> str | None: ...

    def arguments(self) -> str | None: ...

    def arguments_since(self, sent: int) -> str: ...

    def ready(self) -> bool: ...


class NamedArguments(ScannedObject):
    """Mistral's v11 layout, `name{...}`: the name is read before the arguments object, which this
    reads."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def name(self) -> str | None:
        return self._name

    def arguments(self) -> str | None:
        return self.scan.text or None

    def arguments_since(self, sent: int) -> str:
        return self.scan.text[sent:]

    def ready(self) -> bool:
        return not self.scan.error and bool(self.scan.text[1:].strip())


class Call:
    """One call object being read: its reader, the index it was announced with, the arguments sent."""

    def __init__(self, reader: Reader | None = None) -> None:
        self.reader: Reader = reader if reader is not None else CallObject()
        self.index: int | None = None
        self.sent = 0


class Calls:
    """The calls of one answer: announcing them and sending their arguments."""

    def __init__(self, eager: bool, new_id: Callable[[], str]) -> None:
        self.eager = eager
        self.count = 0
        self._new_id = new_id

    def advance(self, out: ToolCallDelta, call: Call) -> None:
        """More of the call's text was read: a stream announces it once ready and sends new arguments."""
        if call.index is None and self.eager and call.reader.ready():
            self._announce(out, call)
        if call.index is not None:
            self._send(out, call)

    def close(self, out: ToolCallDelta, call: Call) -> bool:
        """The call's object closed: whether it is a call (if not, its text is content)."""
        return self.end(out, call, True)

    def end(self, out: ToolCallDelta, call: Call, cut: bool) -> bool:
        """The text ended inside the call's object: a call if a stream announced it, or if the answer
        was `cut` by max_tokens and the call is ready."""
        if call.index is None:
            if not (cut and call.reader.ready()):
                return False
            self._announce(out, call)
        self._send(out, call)
        return True

    def _announce(self, out: ToolCallDelta, call: Call) -> None:
        name = call.reader.name()
        assert name is not None  # ready() checked it
        call.index = self.count
        self.count += 1
        out.tool_calls.append(
            {
                "index": call.index,
                "id": self._new_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )

    def _send(self, out: ToolCallDelta, call: Call) -> None:
        assert call.index is not None
        more = call.reader.arguments_since(call.sent)
        if more:
            add_arguments(out, call.index, more)
            call.sent += len(more)


class CallStream:
    """What the families' stream parsers share: the answer's calls, the content sink, the text not consumed
    yet, and `feed`, which runs the family's `_step` while it makes progress (returns True)."""

    def __init__(self, eager: bool, new_id: Callable[[], str]) -> None:
        self._calls = Calls(eager, new_id)
        self._sink = ContentSink()
        self._buf = ""  # text not consumed yet

    def _read_open_call(self, out: ToolCallDelta, call: Call) -> CallState:
        """Feed the open call the text not consumed yet (its rest stays unconsumed) and say where it stands:
        open (more text wanted), closed (a call: its arguments are sent), cut (its JSON broke after a stream
        announced it: the call ends there) or refused (not a call: the family gives its text back)."""
        self._buf = self._buf[call.reader.feed(self._buf) :]
        self._calls.advance(out, call)
        if call.reader.broken:
            return "refused" if call.index is None else "cut"
        if call.reader.done:
            return "closed" if self._calls.close(out, call) else "refused"
        return "open"

    @property
    def num_calls(self) -> int:
        return self._calls.count

    @property
    def called_tools(self) -> bool:
        """True once a call was announced: the choice's finish_reason becomes "tool_calls"."""
        return self._calls.count > 0

    def feed(self, text: str) -> ToolCallDelta:
        out = ToolCallDelta()
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def _step(self, out: ToolCallDelta) -> bool:
        raise NotImplementedError
