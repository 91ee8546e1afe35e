"""A generation's answer once its requests are admitted: the whole JSON answer, or an SSE stream.

Every sequence's first output is awaited before any byte is sent (`serve_answer`), so a full queue or a
draining engine is a clean 429/503 with a status code even for streams. After that, a stream is SSE
(`data: <json>\n\n`, last `data: [DONE]`, OpenAIEventStream), each choice's chunks carrying its index. A
client that goes away, streaming or not, aborts its requests so the engine frees their KV blocks at once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from fastapi import Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.responses import Response

from graphcache.api.openai import sampling
from graphcache.api.openai.choices import ChatShape, CompletionShape
from graphcache.api.openai.fanout import FanOut, Sampled, best_of, prompt_usage, usage
from graphcache.api.server import answer_json
from graphcache.api.server.errors import APIError, error_body
from graphcache.api.server.executors import run_response

# sse-starlette watches for SIGTERM and cancels every open stream at once; here a SIGTERM drains instead
# (cli.py: in-flight streams finish, or end with an error event and [DONE] at drain_timeout_s), so its
# automatic drain is off for the whole process (left on, tests/reliability/test_sigterm.py's drain test
# sees its streams cut: "peer closed connection without sending complete message body"). Nothing else
# in the server uses sse-starlette.
AppStatus.disable_automatic_graceful_drain()


class OpenAIEventStream(EventSourceResponse):
    """sse-starlette's EventSourceResponse, set up to write exactly what OpenAI's API writes.

    Each event is `data: <json>\n\n` (sep="\n": sse-starlette's default is "\r\n"), the last one
    `data: [DONE]\n\n`; no `event:`/`id:` lines and no keep-alive comments (ping=0): OpenAI and vLLM
    send none, a stream only starts once its first token is out, so it is never idle for long, and a
    comment line would break clients that take every non-blank line for `data:` (tests/api/test_api.py's
    sse_events asserts exactly that). It also sends `Connection: keep-alive` (HTTP/1.1's default anyway).
    No Content-Length; Cache-Control no-cache and X-Accel-Buffering no (nginx must not buffer).
    sse-starlette races a receive() listener against the stream, so a client that hangs up aborts
    its request at once, even while the request waits for its next token (the generator is cancelled).
    `on_close` (the abort) runs however the response ends: also when the client left before the
    generator ever started (closing an unstarted generator runs nothing) or a send failed.
    """

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"}, ping=0, sep="\n")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # the connection broke under a send (ASGI 2.4 servers): nobody is left to tell
            pass
        finally:
            # body_iterator is `events` (sse-starlette keeps an async iterable as given)
            await cast("AsyncGenerator[str, None]", self.body_iterator).aclose()
            self.on_close()


def _echo_only_sample(s: Sampled) -> Sampled:
    """A collected sample without its generated token (ChoicePlan.prompt_only)."""
    return dataclasses.replace(
        s,
        parts=[],
        token_ids=[],
        logprobs=[],
        completion_tokens=0,
        finish_reason="length",
        stop_reason=None,
    )


def _data(obj: Any) -> str:
    """One event's payload; OpenAIEventStream frames it as `data: <json>\n\n`."""
    return json.dumps(obj, ensure_ascii=False)


async def serve_answer(
    request: Request, fan: FanOut, plan: sampling.ChoicePlan, shape: CompletionShape | ChatShape, stream: bool
) -> Response:
    receive = request.receive
    firsts = await fan.start_for(receive)
    if firsts is None:
        return Response(status_code=499)  # nobody reads it; keeps the access log honest
    observe_n(request, plan.n, len(fan.runs) // plan.samples)  # admitted: one per prompt, as vLLM counts

    if not stream:
        samples = await fan.collect_for(receive, firsts)
        if samples is None:
            return Response(status_code=499)
        if plan.prompt_only:
            samples = [_echo_only_sample(s) for s in samples]
        kept = best_of(samples, plan.n) if plan.ranks else samples
        # Built, rendered and its logprobs freed on the response pool, a choice at a time (answer_json.py):
        # up to MAX_ANSWER_BYTES (answer_size.py) of JSON, and the loop keeps answering meanwhile.
        return await run_response(
            answer_json.answer_response, shape, kept, usage(samples), [*samples, *firsts]
        )

    samples = [Sampled(run.sub.prompt_index) for run in fan.runs]
    continuous = shape.body.continuous_usage

    async def events() -> AsyncGenerator[str, None]:
        if plan.prompt_only:
            firsts[:] = [sampling.echo_only(out) for out in firsts]
        merged = fan.merged(firsts)
        try:
            # Continuous usage grows chunk by chunk: the role chunks count the prompts only, each
            # first chunk adds its own tokens.
            for opening in shape.opening(len(samples), prompt_usage(samples, firsts) if continuous else None):
                yield _data(opening)
            for k, out in enumerate(firsts):  # echo's prompt logprobs: built on the response pool
                samples[k].add(out)
                data = await answer_json.chunk_data(shape, k, out, usage(samples) if continuous else None)
                if data is not None:
                    yield data
            async for k, out in merged:
                if plan.prompt_only:
                    out = sampling.echo_only(out)
                samples[k].add(out)
                chunk = shape.chunk(k, out, usage(samples) if continuous else None)
                if chunk is not None:
                    yield _data(chunk)
            if shape.body.include_usage:
                yield _data(shape.usage_chunk(usage(samples)))
        except APIError as e:  # headers are gone: the error travels as an event, like OpenAI's
            yield _data(error_body(e.message, e.type, e.param, e.code))
        finally:
            await merged.aclose()
            fan.abort()
        yield "[DONE]"

    return OpenAIEventStream(events(), on_close=fan.abort)


def observe_n(request: Request, n: int, num_prompts: int) -> None:
    """vllm:request_params_n, once per prompt (vLLM serves each prompt of a batch as its own request)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        for _ in range(num_prompts):
            metrics.vllm.observe_request_n(n)
