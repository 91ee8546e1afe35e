"""One API request as several engine requests: n choices, best_of samples, batched prompts.

Every sequence is its own engine request, id `<rid>-<i>` (i: its position among the request's
sequences), submitted together and run concurrently: the engine batches them, and its prefix cache
shares their prompt's KV. The answer lists them as OpenAI does: prompt p's choice c has index
p * n + c. With best_of > n a prompt's samples are ranked by cumulative logprob (the sum of the
sampled tokens' logprobs) and the n most likely kept. A refusal or failure of any sequence aborts the
others, and is the request's one error. Usage counts each prompt once and every generated token
(best_of's discarded samples too: they were computed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphcache.api.server.disconnect import ClientGone, unless_disconnected
from graphcache.api.server.errors import APIError, api_error_for, api_error_for_ended
from graphcache.engine.errors import EngineDead, EngineNotReady, InvalidRequest, QueueFull
from graphcache.engine.sequence import RequestOutput, SamplingParams, TokenIds, TokenLogprob

__all__ = ["FanOut", "Run", "Sampled", "Sub", "best_of", "prompt_usage", "usage"]


@dataclass
class Sub:
    """One sequence to run: which prompt it samples, with which params."""

    request_id: str
    prompt_index: int
    prompt_ids: list[int] | TokenIds  # a TokenIds is shared by the prompt's samples (immutable)
    params: SamplingParams


@dataclass
class Sampled:
    """What one sequence has produced so far (the sum of its output deltas)."""

    prompt_index: int
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.text)
        self.token_ids += out.token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs)


def best_of(samples: list[Sampled], n: int) -> list[Sampled]:
    """The n most likely samples of each prompt (cumulative logprob, ties: the earlier sample), by prompt."""
    by_prompt: dict[int, list[Sampled]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    out: list[Sampled] = []
    for p in sorted(by_prompt):
        out += sorted(by_prompt[p], key=lambda s: -s.cumulative_logprob)[:n]
    return out


def usage(samples: list[Sampled]) -> dict:
    """OpenAI's usage: each prompt counted once, every generated token; cached prompt tokens (from the
    prefix cache) per prompt the fewest any of its sequences found, so never more than were reused."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    for s in samples:
        prompt_tokens[s.prompt_index] = s.prompt_tokens
        cached[s.prompt_index] = min(cached.get(s.prompt_index, s.num_cached_tokens), s.num_cached_tokens)
    prompt = sum(prompt_tokens.values())
    completion = sum(s.completion_tokens for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def prompt_usage(samples: list[Sampled], firsts: Sequence[RequestOutput]) -> dict:
    """The usage before anything is generated (a stream's role chunks): the prompts of `samples`, whose
    sizes and cache hits `firsts` (each sequence's first output) report; completion_tokens 0."""
    heads = [
        Sampled(s.prompt_index, prompt_tokens=out.prompt_tokens, num_cached_tokens=out.num_cached_tokens)
        for s, out in zip(samples, firsts, strict=True)
    ]
    return usage(heads)


class Run:
    """One engine request: its outputs, and an abort unless it finished."""

    def __init__(
        self,
        engine,
        sub: Sub,
        stream: bool,
        max_tokens_param: str = "max_tokens",
        constraint_param: str | None = None,
    ) -> None:
        self.engine = engine
        self.constraint_param = constraint_param  # the field that set the output constraint, if any
        # stream=False: the engine wakes this request once, at its end, not once per token.
        self.stream = stream
        self.sub = sub
        self.max_tokens_param = max_tokens_param
        self.finished = False
        self._it: AsyncIterator | None = None

    async def next(self) -> RequestOutput:
        """The next output; engine refusals become the API errors that say what to do."""
        try:
            if self._it is None:
                self._it = self.engine.generate(
                    self.sub.request_id,
                    self.sub.prompt_ids,
                    self.sub.params,
                    stream=self.stream,
                    max_tokens_param=self.max_tokens_param,
                ).__aiter__()
            out = await self._it.__anext__()
        except (InvalidRequest, QueueFull, EngineNotReady, EngineDead) as e:
            self.finished = True  # not (or no longer) in the engine: nothing to abort
            raise api_error_for(e) from None
        except StopAsyncIteration:
            self.finished = True
            raise APIError(500, "The engine ended the request without a final output.") from None
        if out.finished:
            self.finished = True
            if out.finish_reason == "error":
                # The request's own doing (its constraint too costly): the client's 400, streamed or not.
                client_error = api_error_for_ended(out.error, out.error_code, self.constraint_param)
                if client_error is not None:
                    raise client_error
                # Ended while the engine drains or has stopped: the drain timeout cut it (Engine.drain),
                # a 503 `shutting_down` with Retry-After. A dead engine's failures stay 500s.
                stopping = self.engine.refusal()
                if stopping is not None and self.engine.alive:
                    raise api_error_for(stopping, in_flight=True)
                raise APIError(
                    500,
                    out.error or "The engine failed on this request; the server log has the details.",
                    code="engine_error",
                )
            if out.finish_reason == "abort":
                raise APIError(
                    503, "The request was aborted (the server is shutting down); retry.", code="aborted"
                )
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.sub.request_id)


async def _settle(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for t in tasks:
        t.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.gather(*tasks, return_exceptions=True)


class FanOut:
    """The sequences of one API request, run together; any failure aborts them all."""

    def __init__(
        self,
        engine,
        subs: list[Sub],
        stream: bool,
        max_tokens_param: str = "max_tokens",
        constraint_param: str | None = None,
    ) -> None:
        self.runs = [Run(engine, s, stream, max_tokens_param, constraint_param) for s in subs]

    def abort(self) -> None:
        for run in self.runs:
            run.abort()

    async def _all(self, coros: list[Awaitable[Any]]) -> list[Any]:
        """Await all; the first failure (in index order among those failed) cancels the rest and aborts all."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                    raise exc
            return [t.result() for t in tasks]
        except BaseException:
            await _settle(tasks)
            self.abort()
            raise

    async def start(self) -> list[RequestOutput]:
        """Submit every sequence; each one's first output (a full queue or a refusal: all aborted, raised).

        The engine checks each submitted sequence on the event loop (work that grows with its token-id
        lists), so sequences are submitted one per loop turn: with n = 128 the loop still answers
        /health between them instead of stalling for all 128 checks at once."""

        async def submitted(run: Run, turn: int) -> RequestOutput:
            for _ in range(turn):
                await asyncio.sleep(0)
            return await run.next()

        return await self._all([submitted(run, turn) for turn, run in enumerate(self.runs)])

    async def collect(self, firsts: list[RequestOutput]) -> list[Sampled]:
        """Every sequence to its end, in submission order."""

        async def finish(run: Run, out: RequestOutput) -> Sampled:
            sampled = Sampled(run.sub.prompt_index)
            sampled.add(out)
            while not out.finished:
                out = await run.next()
                sampled.add(out)
            return sampled

        return await self._all([finish(run, out) for run, out in zip(self.runs, firsts, strict=True)])

    async def start_for(self, receive) -> list[RequestOutput] | None:
        """start() on behalf of the client behind `receive`: None if it left first. Either way, and on any
        failure, nothing is left running that nobody will read."""
        try:
            return await unless_disconnected(receive, self.start())
        except ClientGone:
            self.abort()
            return None
        except BaseException:
            self.abort()
            raise

    async def collect_for(self, receive, firsts: list[RequestOutput]) -> list[Sampled] | None:
        """collect() on behalf of the client behind `receive`: None if it left first; all aborted after."""
        try:
            return await unless_disconnected(receive, self.collect(firsts))
        except ClientGone:
            return None
        finally:
            self.abort()

    async def merged(self, firsts: list[RequestOutput]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(sequence index, output) as they come after `firsts`; closing it aborts what still runs."""
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, out in enumerate(firsts):
                if not out.finished:
                    pending[asyncio.ensure_future(self.runs[i].next())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: pending[t]):
                    i = pending.pop(task)
                    out = task.result()  # an APIError ends the stream; `finally` aborts the rest
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(self.runs[i].next())] = i
        finally:
            await _settle(list(pending))
            self.abort()
