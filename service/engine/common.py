"""Types shared by the engine's two sides: the `Engine` facade (engine.py, asyncio) and the engine
thread (loop.py).

Here: the exceptions the HTTP floor maps to status codes, the RequestOutput deltas a request
streams, the inbox commands the facade puts in the thread-safe queue for the engine thread, and
the JSON helper both sides use for cache reports. They live apart from both sides so neither has
to import the other for them; service.engine.engine re-exports the public ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.engine.sequence import Sequence

# What clients (request errors, unauthenticated probes) are told when the engine dies. The cause
# (an exception text that can carry internal paths and device details) goes to the log and to
# `Engine.error`, which only authenticated /admin/* shows.
DEAD_MESSAGE = "the engine stopped after an unrecoverable error; see the server log"


class QueueFull(Exception):
    """The waiting queue is at max_queue: retry later (HTTP 429)."""


class EngineNotReady(Exception):
    """The model is still loading or warming up (HTTP 503)."""


class EngineDraining(EngineNotReady):
    """The engine stopped accepting requests (SIGTERM drain); HTTP 503."""


class EngineDead(Exception):
    """The engine thread hit an unrecoverable error; `Engine.error` says which (its message does not)."""


@dataclass
class RequestOutput:
    """One streamed delta of a request. The last one has finished=True and a finish_reason."""

    request_id: str
    text: str                      # new text since the previous output
    token_ids: list[int]           # new token ids since the previous output
    finished: bool
    finish_reason: str | None      # stop | length | abort | error (None until finished)
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None       # message when finish_reason == "error" (safe to show a client)


# --- inbox commands ----------------------------------------------------------------------------

@dataclass
class _Handle:
    request_id: str
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    seq: Sequence
    stream: bool = True    # False: only the final output (carrying everything) is delivered


@dataclass
class _Add:
    handle: _Handle


@dataclass
class _Abort:
    request_id: str
    reason: str = "abort"
    error: str | None = None


@dataclass
class _AbortAll:
    reason: str
    error: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class _Stop:
    pass


def _jsonable(obj: Any) -> Any:
    """Cache reports (dataclasses holding descriptors, enums, tuples) -> plain JSON types."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if type(obj).__name__ == "BatchDescriptor":
        return str(obj)
    if hasattr(obj, "to_dict"):
        return _jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [_jsonable(v) for v in obj]
    return str(obj)

