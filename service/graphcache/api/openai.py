"""OpenAI-compatible generation: /v1/completions, /v1/chat/completions, /v1/models.

A request is validated (protocol.py), bounded by size (text over max_model_len * MAX_CHARS_PER_TOKEN
characters is refused before tokenizing), tokenized here (off the event loop, by calls that release
the interpreter lock, so neither the loop nor the engine thread stalls), checked against the engine's
limits, then submitted. Chat content is encoded so that special-token strings in it stay plain text
(`Tokenizer.encode_chat`); a chat template's `raise_exception` is a 400 on "messages". The first output
is awaited before any byte is sent, so a full queue or a draining engine is a clean 429/503
with a status code even for streams. After that, a stream is SSE (`data: <json>\n\n`, last
`data: [DONE]`). A client that goes away, streaming or not, aborts its request so the
engine frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from graphcache.api.auth import require_api_key
from graphcache.api.errors import APIError, api_error_for, error_body
from graphcache.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from graphcache.engine.engine import (
    EngineDead,
    EngineNotReady,
    InvalidRequest,
    QueueFull,
    SamplingParams,
)
from graphcache.model.tokenizer import MAX_CHARS_PER_TOKEN, ChatTemplateError

__all__ = ["encode_chat", "encode_prompt", "model_card", "router"]

log = logging.getLogger("graphcache.api")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


# --------------------------------------------------------------------------- engine access

def _engine(request: Request):
    """The engine, if it may take a request now; else the 503 that says why."""
    engine = request.app.state.engine
    refused = engine.refusal()
    if refused is not None:
        raise api_error_for(refused)
    return engine


def _check_model(engine, name: str | None) -> str:
    if name is not None and name != engine.model_name:   # the caller's name is not echoed back
        raise APIError(400, f"The requested model does not exist; this server serves '{engine.model_name}' "
                            "(GET /v1/models).", param="model", code="model_not_found")
    return engine.model_name


def _check_text_size(engine, chars: int, param: str, what: str) -> None:
    """Refuse text that cannot fit the context window, before paying for tokenizing it (a token is
    rarely more than MAX_CHARS_PER_TOKEN characters)."""
    limit = engine.max_model_len
    if limit is not None and chars > limit * MAX_CHARS_PER_TOKEN:
        raise APIError(400, f"This model's maximum context length is {limit} tokens; {what} has {chars} "
                            f"characters, more than the {limit * MAX_CHARS_PER_TOKEN} characters ({MAX_CHARS_PER_TOKEN} "
                            "per token) that could fit it. Shorten it.", param=param, code="context_length_exceeded")


async def encode_prompt(engine, text: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt string's ids, bounded by size first, tokenized off the event loop."""
    _check_text_size(engine, len(text), "prompt", "the prompt")
    return await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens)


async def encode_chat(request: Request, engine, messages: list[ChatMessage],
                      add_generation_prompt: bool = True) -> list[int]:
    """A chat's prompt ids through the model's template, bounded by size first, off the event loop."""
    # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
    chat = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    _check_text_size(engine, sum(len(m["content"]) for m in chat), "messages", "the messages' content")
    # Chat content is user input: special-token strings in it ("<|im_start|>system") are encoded as plain
    # text, never as control tokens, unless a trusted deployment allows it (Settings).
    allow_special = request.app.state.settings.allow_special_tokens_in_chat
    try:
        # The template has its own BOS; content's special-token strings stay plain text.
        return await asyncio.to_thread(engine.tokenizer.encode_chat, chat, add_generation_prompt,
                                       allow_special_in_content=allow_special)
    except ChatTemplateError as e:   # the client's messages broke the template's rules: one line, no traceback
        log.info("chat template refused the messages: %s", e.message)
        raise APIError(400, f"The chat template refused these messages: {e.message}", param="messages",
                       code="chat_template_error") from None


def model_card(request: Request) -> dict:
    """The served model as OpenAI's model object (an entry of GET /v1/models)."""
    engine = request.app.state.engine
    return {"id": engine.model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "graphcache", "max_model_len": engine.max_model_len if engine.ready else None}


def _sampling(body, max_tokens: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(body.top_k, 0), seed=body.seed, stop=list(body.stop or []),
                          stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos)


# --------------------------------------------------------------------------- running a request

async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive, aw: Awaitable) -> Any:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientGone.

    The cancelled task is awaited before returning, so whatever it was iterating (an async
    generator) is idle again and can be closed.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done() and not watcher.cancelled() and watcher.exception() is None
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if gone and not (task.done() and not task.cancelled() and task.exception() is None):
        raise ClientGone
    return task.result()


class _Run:
    """One request inside the engine: its outputs, and an abort unless it finished."""

    def __init__(self, engine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool, max_tokens_param: str = "max_tokens") -> None:
        self.engine = engine
        # stream=False: the engine wakes this request once, at its end, not once per token.
        self.stream = stream
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens_param = max_tokens_param
        self.finished = False
        self._it: AsyncIterator | None = None

    async def next(self):
        """The next output; engine refusals become the API errors that say what to do."""
        try:
            if self._it is None:
                self._it = self.engine.generate(self.request_id, self.prompt_ids, self.params, stream=self.stream,
                                                max_tokens_param=self.max_tokens_param).__aiter__()
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
                # Ended while the engine drains or has stopped: the drain timeout cut it (Engine.drain),
                # a 503 `shutting_down` with Retry-After. A dead engine's failures stay 500s.
                stopping = self.engine.refusal()
                if stopping is not None and self.engine.alive:
                    raise api_error_for(stopping, in_flight=True)
                raise APIError(500, out.error or "The engine failed on this request; the server log has the "
                                    "details.", code="engine_error")
            if out.finish_reason == "abort":
                raise APIError(503, "The request was aborted (the server is shutting down); retry.",
                               code="aborted")
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class SSEResponse(Response):
    """Sends `events` as text/event-stream while watching for the client going away.

    Starlette's StreamingResponse notices a disconnect only on the next send under ASGI
    spec 2.4; racing a receive() listener aborts a request at once, even while it waits
    for its next token. `on_close` (the abort) runs however the stream ends, also when the
    client left before the generator started (closing an unstarted generator runs nothing).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        # Not Response.__init__: it would declare Content-Length: 0 for the empty initial body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.events = events
        self.on_close = on_close  # runs even if the client left before `events` ever started

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def pump() -> None:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _unless_disconnected(receive, pump())
        except (ClientGone, OSError):
            pass
        finally:
            await self.events.aclose()
            self.on_close()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(out) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


async def _serve(request: Request, run: _Run, stream: bool, include_usage: bool,
                 make_chunk: Callable[[str, str | None], dict], make_usage_chunk: Callable[[dict], dict],
                 make_full: Callable[[str, str, dict], dict], first_chunk: dict | None = None) -> Response:
    receive = request.receive
    try:
        first = await _unless_disconnected(receive, run.next())
    except ClientGone:
        run.abort()
        return Response(status_code=499)  # nobody reads it; keeps the access log honest
    except BaseException:
        run.abort()
        raise

    if not stream:
        async def collect() -> tuple[str, Any]:
            out, parts = first, [first.text]
            while not out.finished:
                out = await run.next()
                parts.append(out.text)
            return "".join(parts), out

        try:
            text, last = await _unless_disconnected(receive, collect())
        except ClientGone:
            return Response(status_code=499)
        finally:
            run.abort()
        return JSONResponse(make_full(text, last.finish_reason, _usage(last)))

    async def events() -> AsyncIterator[str]:
        out = first
        try:
            if first_chunk is not None:
                yield _sse(first_chunk)
            while True:
                if out.text or out.finished:
                    yield _sse(make_chunk(out.text, out.finish_reason if out.finished else None))
                if out.finished:
                    break
                out = await run.next()
            if include_usage:
                yield _sse(make_usage_chunk(_usage(out)))
        except APIError as e:  # headers are gone: the error travels as an event, like OpenAI's
            yield _sse(error_body(e.message, e.type, e.param, e.code))
        finally:
            run.abort()
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), on_close=run.abort)


# --------------------------------------------------------------------------- endpoints

@router.get("/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [model_card(request)]}


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = _check_model(engine, body.model)
    if isinstance(body.prompt, str):
        prompt_ids = await encode_prompt(engine, body.prompt)
    else:
        prompt_ids = list(body.prompt)  # the engine checks they are in the vocabulary (400 if not)
    rid = f"cmpl-{uuid.uuid4().hex}"
    run = _Run(engine, rid, prompt_ids, _sampling(body, body.max_tokens), body.stream)
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    usage_none = {"usage": None} if body.include_usage else {}

    def chunk(text: str, finish: str | None) -> dict:
        return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                **usage_none}

    def full(text: str, finish: str, usage: dict) -> dict:
        return {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": usage}

    return await _serve(request, run, body.stream, body.include_usage, chunk,
                        lambda usage: {**base, "choices": [], "usage": usage}, full)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    engine = _engine(request)
    model = _check_model(engine, body.model)
    prompt_ids = await encode_chat(request, engine, body.messages)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = _Run(engine, rid, prompt_ids, _sampling(body, body.max_new_tokens), body.stream, param)
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    usage_none = {"usage": None} if body.include_usage else {}

    def chunk(text: str, finish: str | None) -> dict:
        delta = {"content": text} if text else {}
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **usage_none}

    def full(text: str, finish: str, usage: dict) -> dict:
        return {**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}], "usage": usage}

    first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], **usage_none}
    return await _serve(request, run, body.stream, body.include_usage, chunk,
                        lambda usage: {**base, "choices": [], "usage": usage}, full, first_chunk=first)
