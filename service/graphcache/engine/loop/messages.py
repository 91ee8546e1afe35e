"""What crosses between the asyncio side of the Engine and its engine thread.

Inbox commands (asyncio side -> engine thread, through a queue.Queue): Add, Abort, AbortAll, Call,
Stop. Outputs (engine thread -> a request's consumer, through `loop.call_soon_threadsafe(deliver, ...)`
into the request's asyncio.Queue: `dispatch`), and what the consumer does with them (`consume`): merge
deltas that queued up, and detokenize streams the engine left without text. `jsonable` turns admin
reports into JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from graphcache.engine.sequence import RequestOutput, Sequence
from graphcache.graphs.cache_reports import WarmupReport
from graphcache.graphs.descriptor import BatchDescriptor

__all__ = [
    "Abort",
    "AbortAll",
    "Add",
    "Call",
    "Fail",
    "Handle",
    "Stop",
    "WarmupJob",
    "consume",
    "deliver",
    "dispatch",
    "settle",
    "jsonable",
    "merge",
    "pack_outputs",
    "unpack_outputs",
    "with_text",
]


@dataclass
class Handle:
    """A request as the asyncio side sees it: where its outputs go (`loop.call_soon_threadsafe(deliver,
    [(outputs, out), ...])`; in the engine process, `loop` is a sink that sends them to the API process)."""

    request_id: str
    loop: Any
    outputs: asyncio.Queue | None
    seq: Sequence


@dataclass
class Add:
    handle: Handle


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    reason: str
    error: str


@dataclass
class Call:
    fn: Callable[[], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Stop:
    pass


@dataclass
class Fail:
    """The engine cannot go on (e.g. a tensor-parallel rank died): the engine thread dies on it."""

    reason: str


@dataclass
class WarmupJob:
    """An admin warmup: the engine thread captures `todo` a slice at a time between steps."""

    descriptors: list[BatchDescriptor] | None  # None: the configured warmup
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    todo: deque = field(default_factory=deque)
    total: int = 0
    report: WarmupReport = field(default_factory=WarmupReport)


def jsonable(obj: Any) -> Any:
    """Cache reports (dataclasses holding descriptors, dicts, lists) -> plain JSON types."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, BatchDescriptor):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return str(obj)


def with_text(out: RequestOutput, detok: Any) -> RequestOutput:
    """`out` with the text of its token ids. A final stop token or EOS adds no text (as the engine-side
    path does it); a "stop" because a grammar completed keeps its last token's text."""
    ids = out.token_ids
    if out.finished and out.stopped_on_token and ids:
        ids = ids[:-1]
    text = detok.add(list(ids)) if ids else ""
    if out.finished:
        text += detok.finish()
    return dataclasses.replace(out, text=out.text + text)


def merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: texts, ids and logprobs concatenated; the prompt's
    logprobs and cached-token count, which only the first delta carries, kept."""
    logprobs = (
        first.logprobs + then.logprobs
        if first.logprobs is not None and then.logprobs is not None
        else first.logprobs
        if then.logprobs is None
        else then.logprobs
    )
    return dataclasses.replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
        num_cached_tokens=max(first.num_cached_tokens, then.num_cached_tokens),
    )


def deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:  # runs on the consumers' event loop
        q.put_nowait(out)


def dispatch(routed: list[tuple[Handle, RequestOutput]]) -> None:
    """Hand outputs to their consumers: one wakeup per event loop (or sink) for the whole list, not
    one per request. Any thread."""
    by_loop: dict[Any, list[tuple[asyncio.Queue | None, RequestOutput]]] = {}
    for handle, out in routed:
        by_loop.setdefault(handle.loop, []).append((handle.outputs, out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
            loop.call_soon_threadsafe(deliver, items)


async def consume(
    handle: Handle, tokenizer: Any, abort: Callable[[str], None]
) -> AsyncIterator[RequestOutput]:
    """A request's outputs, as its consumer iterates them: deltas that queued up while the consumer was
    busy merged into one, streams detokenized here. Leaving early (disconnect, cancel, break) calls
    abort(request_id), which frees its KV blocks."""
    finished = False
    seq = handle.seq
    # Streams without stop strings are detokenized here, on the consumer's side (EngineCore leaves
    # their text empty): the step loop never pays for it, and a merged delta is decoded in one call.
    queue = handle.outputs
    assert queue is not None, "consume() runs on the asyncio side, whose handles carry an outputs queue"
    detok = None
    if seq.stream and not seq.params.stop and tokenizer is not None:
        detok = tokenizer.detokenizer(
            seq.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
        )
    try:
        while True:
            out: RequestOutput = await queue.get()
            # Under load a stream sends fewer, larger chunks instead of falling behind one token at a time.
            while not out.finished and not queue.empty():
                out = merge(out, queue.get_nowait())
            if detok is not None:
                out = with_text(out, detok)
            finished = out.finished
            yield out
            if finished:
                return
    finally:
        if not finished:  # the consumer left (disconnect, cancel, break): free its blocks now
            abort(handle.request_id)


def settle(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
    result: Any = None,
    exc: BaseException | None = None,
) -> None:
    """Any thread: resolve an admin call's future on its loop (nothing if the caller was cancelled or
    its loop is closed)."""

    def resolve() -> None:
        if future.done():
            return  # the awaiting task was cancelled
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
        loop.call_soon_threadsafe(resolve)


def pack_outputs(outputs: list[RequestOutput]) -> tuple[list[tuple], list[RequestOutput]]:
    """A step's outputs for the pipe: ([(id, token_ids, prompt_tokens, completion_tokens)] for the plain
    deltas (no text, logprobs or error, not finished: nearly all of them), [the others as they are]).
    Why: pickling a dataclass goes through its __dict__; at 256 streams a step's message cost the
    engine thread 0.23 ms to pickle and the API process 0.35 ms to load, tuples ~0.02 and ~0.04 ms."""
    plain, full = [], []
    for o in outputs:
        if (
            o.finished
            or o.text
            or o.logprobs is not None
            or o.prompt_logprobs is not None
            or o.error is not None
            or o.num_cached_tokens
        ):
            full.append(o)
        else:
            plain.append((o.request_id, o.token_ids, o.prompt_tokens, o.completion_tokens))
    return plain, full


def unpack_outputs(packed: tuple[list[tuple], list[RequestOutput]]) -> list[RequestOutput]:
    plain, full = packed
    return [
        RequestOutput(rid, "", ids, False, None, prompt, completion) for rid, ids, prompt, completion in plain
    ] + full
