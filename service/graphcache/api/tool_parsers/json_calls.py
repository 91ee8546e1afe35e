"""The machinery the JSON-call families (llama3_json.py, mistral.py) share: read a run of call
objects that may still be incomplete, check them, and stream them as OpenAI tool_call deltas.

A family gives a `reader`: the text after its start marker -> (the call objects read so far, the last
one possibly partial, as partial-json-parser completes it; how many of them are complete). Arguments
are sent as `json.dumps(arguments)` of the parsed object, so streamed fragments add up to exactly what
the complete parse gives: while a call is open, what is sent is the part of the partial object's dump
that cannot change any more (the dump minus its closing brackets and quotes, and no further than it
agrees with the previous dump); the rest goes when the call's object is complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from graphcache.api.tool_parsers.base import ToolCallDelta, add_arguments, new_call_id

__all__ = ["CallsReader", "JsonCallsStream", "call_of", "dump_arguments", "read_partial"]

# What the last, unfinished value may be completed from: a partial number ("1" of "12") is left out,
# as its dump could still change into something it is not a prefix of ("1" -> "1e5" -> 100000.0).
PARTIAL = Allow.ALL & ~Allow.NUM
CLOSERS = '}]"'

CallsReader = Callable[[str], tuple[list[Any], int]]


def read_partial(text: str) -> Any:
    """partial-json-parser's completion of an unfinished JSON value; None if it cannot be read."""
    try:
        return partial_loads(text, PARTIAL)
    except Exception:  # its errors are not one class: any unreadable prefix is "nothing yet"
        return None


def dump_arguments(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def call_of(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object {"name", "arguments" or "parameters"}, or
    None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], dump_arguments(args)) if isinstance(args, dict) else None


def _arguments(obj: dict[str, Any]) -> Any:
    return obj.get("arguments", obj.get("parameters"))


class JsonCallsStream:
    """Streams the calls in the text that follows a family's start marker (the family's own stream
    class finds the marker and hands over the rest with feed_calls)."""

    def __init__(self, reader: CallsReader) -> None:
        self._reader = reader
        self._text = ""
        self._sent: list[str] = []  # arguments text sent, per announced call
        self._stable: list[str] = []  # the previous dump's settled part, per announced call
        self._closed: list[bool] = []
        self.num_calls = 0

    @property
    def called_tools(self) -> bool:
        return self.num_calls > 0

    def feed_calls(self, text: str, out: ToolCallDelta, final: bool = False) -> None:
        self._text += text
        calls, complete = self._reader(self._text)
        for i, obj in enumerate(calls):
            done = i < complete
            if not isinstance(obj, dict):
                return
            if i >= self.num_calls and not self._announce(obj, done, out):
                return
            if not self._closed[i]:
                self._advance(i, obj, done, out)
            if not done and not final:
                return

    def _announce(self, obj: dict[str, Any], done: bool, out: ToolCallDelta) -> bool:
        # The name is complete once a key after it is there (or the object closed).
        has_args = "arguments" in obj or "parameters" in obj
        if not isinstance(obj.get("name"), str) or not (has_args or done):
            return False
        if done and call_of(obj) is None:
            return False  # a complete object that is not a call: never announced
        out.tool_calls.append(
            {
                "index": self.num_calls,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": obj["name"], "arguments": ""},
            }
        )
        self.num_calls += 1
        self._sent.append("")
        self._stable.append("")
        self._closed.append(False)
        return True

    def _advance(self, i: int, obj: dict[str, Any], done: bool, out: ToolCallDelta) -> None:
        sent = self._sent[i]
        if done:
            parsed = call_of(obj)
            final = parsed[1] if parsed is not None else sent
            more = final[len(sent) :] if final.startswith(sent) else ""
            self._closed[i] = True
        else:
            args = _arguments(obj)
            if not isinstance(args, dict):
                return
            dump = dump_arguments(args).rstrip(CLOSERS)
            settled = _common_prefix(dump, self._stable[i]) if self._stable[i] else dump
            self._stable[i] = dump
            more = settled[len(sent) :] if len(settled) > len(sent) and settled.startswith(sent) else ""
        if more:
            self._sent[i] = sent + more
            add_arguments(out, i, more)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]
