"""POST /v1/responses: a Responses request run through the chat path, answered as a `response` object
or its stream of events.

The body (protocol.py) is checked, converted into a chat completion request (conversion.py) and served
as /v1/chat/completions serves one (api/openai/routes.py and the modules it calls: template, tools, output constraint, sampling
defaults, size bounds, the engine's first output awaited before a byte is sent, so a refusal is a
plain 400/429/503), with one sequence (the Responses API has no `n`). Its chat answer, reasoning split
off and tool calls parsed by the chat shape (api/openai/choices.py), becomes output items (output.py) or
events (events.py). Errors name the Responses field (input, text.format, max_output_tokens,
reasoning.effort), not the chat field behind it. Responses are not stored: GET and cancel of a
response id answer 404 saying so.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError
from sse_starlette import ServerSentEvent
from starlette.responses import Response

from graphcache.api.openai import generation_answer, request_constraints, routes, sampling, served_model
from graphcache.api.openai.answer_size import check_answer_size
from graphcache.api.openai.choices import ChatShape, Prompt
from graphcache.api.openai.fanout import FanOut, Sampled, usage
from graphcache.api.openai.logprobs import TokenText
from graphcache.api.openai.prompt_encoding import encode_chat
from graphcache.api.openai.protocol import ChatCompletionRequest
from graphcache.api.openai.responses.conversion import chat_fields
from graphcache.api.openai.responses.events import ResponseEvents
from graphcache.api.openai.responses.output import (
    ResponseHead,
    finish_status,
    new_item_id,
    output_items,
    response_usage,
)
from graphcache.api.openai.responses.protocol import ResponsesRequest
from graphcache.api.openai.tool_parsers import tool_call_format
from graphcache.api.server.answer_json import render, render_text
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError, api_error_for
from graphcache.api.server.executors import run_input, run_response
from graphcache.engine.errors import InvalidRequest

__all__ = ["router"]

log = logging.getLogger("graphcache.api")

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])

# The chat fields a Responses request sets under other names.
_PARAMS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}


def _responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    for chat, ours in _PARAMS.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            # messages[i] is not input[i] (instructions and merged items shift it): the whole input
            return ours if chat == "messages" else ours + param[len(chat) :]
    return param


def _renamed(e: APIError) -> APIError:
    param = _responses_param(e.param)
    if param == e.param:
        return e
    renamed = APIError(e.status, e.message, param=param, code=e.code, type=e.type, headers=e.headers)
    return renamed


def _chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this one runs as; a field the chat refuses is a 400 naming the Responses field."""
    try:
        body.check()
        return ChatCompletionRequest.model_validate(chat_fields(body))
    except InvalidRequest as e:
        raise api_error_for(e) from None
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if isinstance(p, str) and p.isidentifier()]
        param = _responses_param(loc[0] if loc else None)
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


async def _reasoning_tokens(tokenizer, reasoning: str | None) -> int:
    """output_tokens_details.reasoning_tokens: the reasoning text's length in tokens."""
    if not reasoning:
        return 0
    return len(await run_input(tokenizer.encode, reasoning, False))


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    try:
        return await _create(body, request)
    except APIError as e:
        raise _renamed(e) from None


async def _create(body: ResponsesRequest, request: Request) -> Response:
    chat = _chat_request(body)
    routes.check_body(chat, request)
    tools = request_constraints.template_tools(chat.tools)
    http = request.app.state.settings.http
    constraint = request_constraints.output_constraint(
        chat,
        request_constraints.forced_tool_spec(chat, http.tool_call_parser),
        http.json_disable_any_whitespace,
    )
    engine = served_model.generating_engine(request, "/v1/responses")
    model = served_model.check_model(engine, chat.model)
    await request_constraints.check_constraint(engine, constraint)
    ids = await encode_chat(
        request,
        engine,
        chat.messages,
        chat.add_generation_prompt,
        chat.template_kwargs,
        tools,
        chat_template=chat.request_template,  # chat_template_kwargs' "chat_template", as the chat takes it
        continue_final_message=chat.continue_final_message,
    )
    prompts = [Prompt(ids)]
    base = await routes.request_params(engine, chat, constraint[0] if constraint else None, model, len(ids))
    plan = sampling.plan(chat)
    check_answer_size(chat, plan, base, prompts, engine.max_model_len)
    rid = body.request_id or new_item_id("resp")
    routes.log_caller(chat, rid)
    if body.safety_identifier is not None:  # OpenAI's end-user id for abuse tracing, like `user`
        log.info("request %s: safety_identifier=%r", rid, body.safety_identifier)
    fan = FanOut(
        engine,
        await routes.sub_requests(engine, f"resp-{uuid.uuid4().hex}", prompts, base, plan),
        chat.stream,
        "max_output_tokens",
        _responses_param(constraint[1]) if constraint else None,
    )
    shape = ChatShape(
        chat,
        {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model},
        prompts,
        TokenText(engine.tokenizer),
    )
    shape.parse_tools = chat.tools_active
    shape.tool_format = tool_call_format(http.tool_call_parser)
    shape.reasoning_parser = http.reasoning_parser
    head = ResponseHead(rid, model, body, base.temperature, base.top_p)
    return await _serve(request, fan, shape, head, chat.stream)


def _whole(shape: ChatShape, head: ResponseHead, s: Sampled) -> tuple[dict[str, Any], str | None]:
    """The response object (usage without reasoning tokens yet) and the reasoning text to count."""
    choice = shape.choice(0, s)
    message = choice["message"]
    status, incomplete = finish_status(s.finish_reason)
    output = output_items(message, choice["logprobs"], s.finish_reason)
    return head.response(status, output, None, incomplete), message.get("reasoning")


async def _serve(
    request: Request, fan: FanOut, shape: ChatShape, head: ResponseHead, stream: bool
) -> Response:
    receive = request.receive
    firsts = await fan.start_for(receive)
    if firsts is None:
        return Response(status_code=499)  # nobody reads it; keeps the access log honest
    generation_answer.observe_n(request, 1, 1)
    tokenizer = shape.text_of.tokenizer

    if not stream:
        samples = await fan.collect_for(receive, firsts)
        if samples is None:
            return Response(status_code=499)
        answer, thought = await run_response(_whole, shape, head, samples[0])
        answer["usage"] = response_usage(usage(samples), await _reasoning_tokens(tokenizer, thought))
        return Response(await run_response(render, answer), media_type="application/json")

    sampled = Sampled(0)
    events = ResponseEvents()
    reasoning: list[str] = []

    def frame(event: dict[str, Any]) -> ServerSentEvent:
        return ServerSentEvent(data=render_text(event), event=event["type"], sep="\n")  # as OpenAIEventStream

    def fed(out) -> list[dict[str, Any]]:
        sampled.add(out)
        chunk = shape.chunk(0, out, None)
        if chunk is None:
            return []
        choice = chunk["choices"][0]
        reasoning.append(choice["delta"].get("reasoning") or "")
        return events.feed(choice)

    async def sse() -> AsyncGenerator[ServerSentEvent, None]:
        merged = fan.merged(firsts)
        try:
            for event in events.opening(head.response("in_progress", [])):
                yield frame(event)
            for out in firsts:
                for event in fed(out):
                    yield frame(event)
            async for _, out in merged:
                for event in fed(out):
                    yield frame(event)
            status, incomplete = finish_status(sampled.finish_reason)
            for event in events.finish(status):
                yield frame(event)
            spent = response_usage(usage([sampled]), await _reasoning_tokens(tokenizer, "".join(reasoning)))
            yield frame(events.closing(head.response(status, events.output(status), spent, incomplete)))
        except APIError as e:  # headers are gone: the error travels as events, as OpenAI sends it
            e = _renamed(e)
            yield frame(events.event("error", code=e.code, message=e.message, param=e.param))
            error = {"code": e.code or e.type, "message": e.message}
            failed = head.response("failed", events.output("incomplete"), None, None, error)
            yield frame(events.event("response.failed", response=failed))
        finally:
            await merged.aclose()
            fan.abort()

    # OpenAIEventStream frames strings as `data:` lines; a ServerSentEvent adds its `event:` line.
    return generation_answer.OpenAIEventStream(cast("AsyncGenerator[str, None]", sse()), on_close=fan.abort)


def _not_stored(response_id: str) -> APIError:
    return APIError(
        404,
        "Responses are not stored on this server (the stateless subset of the Responses API): "
        "keep the response you were sent and pass its items as input.",
        param="response_id",
        code="response_not_found",
    )


@router.get("/responses/{response_id}")
async def get_response(response_id: str) -> Response:
    raise _not_stored(response_id)


@router.post("/responses/{response_id}/cancel")
async def cancel_response(response_id: str) -> Response:
    raise _not_stored(response_id)
