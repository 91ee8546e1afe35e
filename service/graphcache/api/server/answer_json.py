"""Large answers rendered off the event loop, in pieces.

json.dumps is one C call that holds the interpreter lock from the first byte to the last: a 100 MB
answer holds it for seconds, and moving the call to a worker thread does not help the event loop, which
needs that lock too. So an answer is rendered here, on the response pool (api/server/executors.py), piece by
piece: dicts key by key, `Lazy` arrays item by item (the choices: each one is built, rendered and
dropped before the next, so the answer's dict tree never exists whole), and lists longer than SLICE
items in slices of SLICE (prompt_logprobs, logprobs: ~20 KB of JSON each at 20 logprobs). Between
pieces the interpreter lock can change hands, so /health answers while a large answer is built. The
bytes are those json.dumps would write with the same settings (starlette's JSONResponse's for a whole
answer, json.dumps' defaults for a stream event).

After rendering, the logprobs the sequences held are dropped on the same worker thread: at the answer
bound (api/openai/answer_size.py) they are millions of objects, whose freeing would otherwise stall the loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.responses import Response

from graphcache.api.server.executors import run_response

__all__ = ["SLICE", "Lazy", "answer_response", "chunk_data", "render", "render_text"]

SLICE = 256  # list items per C call: a slice of prompt_logprobs at 20 is ~20 KB, well under a millisecond

# starlette's JSONResponse.render: compact, no NaN/Infinity (a ValueError, as there)
_ANSWER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
_STREAM = json.JSONEncoder(ensure_ascii=False)  # json.dumps(obj, ensure_ascii=False): openai._data's


class Lazy:
    """A JSON array whose items are made while it is rendered (each built, rendered and dropped in turn)."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items


class _Writer:
    def __init__(self, encoder: json.JSONEncoder, as_bytes: bool) -> None:
        self.encoder = encoder
        self.as_bytes = as_bytes
        item, key = encoder.item_separator, encoder.key_separator
        self.marks = {m: m.encode() if as_bytes else m for m in ("{", "}", "[", "]", item, key)}
        self.item, self.key = self.marks[item], self.marks[key]
        self.out: list[Any] = []

    def encode(self, obj: Any) -> Any:
        text = self.encoder.encode(obj)
        return text.encode("utf-8") if self.as_bytes else text

    def write(self, obj: Any) -> None:
        out, marks = self.out, self.marks
        if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
            out.append(marks["{"])
            for i, (key, value) in enumerate(obj.items()):
                if i:
                    out.append(self.item)
                out.append(self.encode(key))
                out.append(self.key)
                self.write(value)
            out.append(marks["}"])
        elif isinstance(obj, Lazy):
            out.append(marks["["])
            for i, item in enumerate(obj.items):
                if i:
                    out.append(self.item)
                self.write(item)
            out.append(marks["]"])
        elif isinstance(obj, list) and len(obj) > SLICE:
            out.append(marks["["])
            for start in range(0, len(obj), SLICE):
                if start:
                    out.append(self.item)
                out.append(self.encode(obj[start : start + SLICE])[1:-1])
            out.append(marks["]"])
        else:
            out.append(self.encode(obj))


def render(obj: Any) -> bytes:
    """`obj` as JSONResponse renders it (UTF-8, compact), written in pieces (see the module docstring)."""
    writer = _Writer(_ANSWER, as_bytes=True)
    writer.write(obj)
    return b"".join(writer.out)


def render_text(obj: Any) -> str:
    """`obj` as json.dumps(obj, ensure_ascii=False) writes it, in pieces."""
    writer = _Writer(_STREAM, as_bytes=False)
    writer.write(obj)
    return "".join(writer.out)


def _drop_logprobs(held: Iterable[Any]) -> None:
    """Drop the logprob lists of collected sequences (fanout.Sampled) and engine outputs (RequestOutput)."""
    for obj in held:
        if getattr(obj, "logprobs", None):
            obj.logprobs = []
        if getattr(obj, "prompt_logprobs", None) is not None:
            obj.prompt_logprobs = None


def answer_response(shape: Any, kept: list, usage: dict, held: Iterable[Any] = ()) -> Response:
    """On the response pool: the whole answer of `shape` (choices.py) for the `kept` sequences, rendered a
    choice at a time; then the logprobs of `held` (every collected sequence and engine output) dropped
    here, off the event loop. Nothing may read `held`'s logprobs afterwards."""
    body = shape.render(kept, usage)
    _drop_logprobs(held)
    return Response(body, media_type="application/json")


def _chunk_data(shape: Any, k: int, out: Any, usage: dict | None) -> str | None:
    chunk = shape.chunk(k, out, usage)
    return None if chunk is None else render_text(chunk)


async def chunk_data(shape: Any, k: int, out: Any, usage: dict | None) -> str | None:
    """A stream event's payload for sequence k's output `out` (None: nothing to send). A first chunk that
    carries the prompt's logprobs (completions with echo and logprobs: prompt tokens x (logprobs + 2)
    entries) is built and rendered on the response pool; every other chunk is small, and built here."""
    if shape.heavy_chunk(k):
        return await run_response(_chunk_data, shape, k, out, usage)
    chunk = shape.chunk(k, out, usage)
    return None if chunk is None else json.dumps(chunk, ensure_ascii=False)
