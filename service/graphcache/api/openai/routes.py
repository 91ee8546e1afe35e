"""OpenAI-compatible generation: /v1/completions, /v1/chat/completions, /v1/models.

A request is validated (protocol.py: every field of vLLM's requests is honoured or refused with a 400
naming it), bounded by size (text over max_model_len * MAX_CHARS_PER_TOKEN characters is refused before
tokenizing), tokenized (prompt_encoding.py: off the event loop, by calls that release the interpreter lock,
so neither the loop nor the engine thread stalls), turned into one engine request per sequence (sampling.py,
fanout.py: n, best_of and batched prompts), its answer's size bounded (answer_size.py: a 400 past
MAX_ANSWER_BYTES, before anything runs), checked against the engine's limits, then submitted.
Chat content is encoded so that special-token strings in it stay plain text (`Tokenizer.encode_chat`);
a chat template's `raise_exception` is a 400 on "messages". Tools (OpenAI function tools), role "tool"
messages and earlier assistant tool_calls are rendered by the template; the tools and the output
constraint (response_format, guided_*, structured_outputs, a tool_choice grammar) are checked and
compiled before submitting (request_constraints.py), and the answer's text is parsed back into
`tool_calls` (streams: per-choice deltas, choices.py). The engine and model a request is served by are
served_model.py's; the answer, the whole JSON or an SSE stream, is generation_answer.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from graphcache.api.openai import beam_search, sampling, token_ids
from graphcache.api.openai.answer_size import check_answer_size
from graphcache.api.openai.choices import ChatShape, CompletionShape, Prompt
from graphcache.api.openai.fanout import FanOut, Sub
from graphcache.api.openai.generation_answer import serve_answer
from graphcache.api.openai.logprobs import TokenText
from graphcache.api.openai.prompt_encoding import encode_chat, encode_prompt
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.openai.request_constraints import (
    check_constraint,
    forced_tool_spec,
    output_constraint,
    template_tools,
)
from graphcache.api.openai.served_model import check_model, generating_engine, model_cards
from graphcache.api.openai.tool_parsers import tool_call_format
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError, api_error_for
from graphcache.api.server.executors import run_input
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import StructuredSpec, TokenIds

# encode_chat / encode_prompt live in prompt_encoding.py; re-exported for callers that import them from here.
__all__ = [
    "check_body",
    "encode_chat",
    "encode_prompt",
    "log_caller",
    "request_params",
    "router",
    "sub_requests",
]

log = logging.getLogger("graphcache.api")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


def check_body(body: CompletionRequest | ChatCompletionRequest, request: Request | None = None) -> None:
    """The body's cross-field rules, before the engine is looked at; a priority only where the server
    schedules by it (vLLM refuses it under fcfs as well)."""
    try:
        body.check()
        beam_search.check(body)
    except InvalidRequest as e:
        raise api_error_for(e) from None
    policy = request.app.state.settings.engine.scheduling_policy if request is not None else "fcfs"
    if body.priority != 0 and policy != "priority":
        raise APIError(
            400,
            f"priority {body.priority} needs priority scheduling, and this server schedules first come, "
            "first served: leave priority at 0, or start the server with --scheduling-policy priority",
            param="priority",
        )


def _ids(prefix: str, body) -> tuple[str, str]:
    """(the response's id, the engine's request id prefix): a client's request_id names the response
    only; engine ids stay unique whatever clients send."""
    engine_rid = f"{prefix}-{uuid.uuid4().hex}"
    return (f"{prefix}-{body.request_id}" if body.request_id else engine_rid), engine_rid


def log_caller(body, rid: str) -> None:
    if body.user is not None or body.session_id is not None:  # OpenAI's end-user id: kept for abuse tracing
        log.info("request %s: user=%r session_id=%r", rid, body.user, body.session_id)


async def sub_requests(
    engine, engine_rid: str, prompts: list[Prompt], base, plan: sampling.ChoicePlan
) -> list[Sub]:
    """One engine request per (prompt, sample), sequence k = prompt * samples + i, id `<rid>-<k>`. Each
    prompt's ids are checked once, off the event loop, and shared by its samples (token_ids.py)."""
    vocab = token_ids.vocab_size(engine)
    shared = [await run_input(token_ids.shared_prompt_ids, prompt.ids, vocab) for prompt in prompts]
    return [
        Sub(f"{engine_rid}-{p * plan.samples + i}", p, shared[p], sampling.choice_params(base, i, plan))
        for p in range(len(prompts))
        for i in range(plan.samples)
    ]


# --------------------------------------------------------------------------- endpoints


@router.get("/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": model_cards(request)}


async def _completion_prompt(
    engine, body: CompletionRequest, index: int, prompt: str | list[int], batch: bool
) -> Prompt:
    param = f"prompt[{index}]" if batch else "prompt"
    if isinstance(prompt, str):
        ids = await encode_prompt(engine, prompt, body.add_special_tokens, param)
    else:
        ids = prompt
    kept = sampling.truncate_prompt(
        ids, body.truncate_prompt_tokens, body.truncation_side, engine.max_model_len
    )
    if not isinstance(prompt, str):  # length and vocabulary, before echo decodes them or n copies them
        kept = await run_input(
            token_ids.check_prompt_ids, kept, token_ids.vocab_size(engine), engine.max_model_len, param
        )
    echo = ""
    if body.echo:  # the prompt as sent; a truncated text prompt as its decoding (the BOS the server added
        # left out), a token-id prompt with its special tokens kept: they are the client's (vLLM's echo)
        if isinstance(prompt, str) and kept is ids:
            echo = prompt
        else:
            echo = await run_input(engine.tokenizer.decode, kept, isinstance(prompt, str))
    return Prompt(kept, echo)


def _checked_token_controls(body, vocab: int | None) -> TokenIds | None:
    """allowed_token_ids deduplicated and range-checked, logit_bias keys range-checked: once per
    request (the engine checks each choice's copy again, so the copies must be small)."""
    token_ids.check_bias_ids(body.logit_bias, vocab)
    if body.allowed_token_ids is None:
        return None
    return token_ids.unique_token_ids(body.allowed_token_ids, vocab)


def _room(engine, num_prompt_tokens: int) -> int | None:
    """Tokens a request may generate after its prompt: the context window, capped by the KV cache."""
    window = engine.max_model_len
    if window is None:
        return None
    checker = engine.checker
    if checker is not None:
        window = min(window, checker.limits.max_tokens_capacity)
    return window - num_prompt_tokens


async def request_params(
    engine, body, structured: StructuredSpec | None, model: str, num_prompt_tokens: int | None = None
):
    """The SamplingParams every choice shares, its token-id controls checked off the event loop, the
    model's generation defaults filling the fields the request left out; `model` an adapter's name runs
    it through that LoRA adapter."""
    allowed = await run_input(_checked_token_controls, body, token_ids.vocab_size(engine))
    bad_words = await sampling.bad_words_token_ids(engine.tokenizer, body.bad_words)
    defaults = engine.generation_defaults
    room = _room(engine, num_prompt_tokens) if num_prompt_tokens is not None and defaults else None
    base = sampling.base_params(body, bad_words, structured, defaults, room)
    lora = None if model == engine.model_name else model
    return dataclasses.replace(base, allowed_token_ids=allowed, lora_name=lora)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    check_body(body, request)
    engine = generating_engine(request, "/v1/completions")
    model = check_model(engine, body.model)
    constraint = output_constraint(
        body, compact_default=request.app.state.settings.http.json_disable_any_whitespace
    )
    await check_constraint(engine, constraint)
    structured = constraint[0] if constraint else None
    batch = len(body.prompts) > 1
    prompts = [await _completion_prompt(engine, body, i, p, batch) for i, p in enumerate(body.prompts)]
    base = await request_params(engine, body, structured, model)
    plan = sampling.plan(body)
    check_answer_size(body, plan, base, prompts, engine.max_model_len)
    rid, engine_rid = _ids("cmpl", body)
    log_caller(body, rid)
    fan = FanOut(
        engine,
        await sub_requests(engine, engine_rid, prompts, base, plan),
        body.stream,
        constraint_param=constraint[1] if constraint else None,
    )
    shape = CompletionShape(
        body,
        {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model},
        prompts,
        TokenText(engine.tokenizer, body.return_tokens_as_token_ids),
    )
    if body.use_beam_search:
        return await beam_search.answer(
            request, engine, body, shape, prompts, [body.max_tokens] * len(prompts)
        )
    return await serve_answer(request, fan, plan, shape, body.stream)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    check_body(body, request)
    tools = template_tools(body.tools)
    api_settings = request.app.state.settings.http
    compact = request.app.state.settings.http.json_disable_any_whitespace
    constraint = output_constraint(body, forced_tool_spec(body, api_settings.tool_call_parser), compact)
    engine = generating_engine(request, "/v1/chat/completions")
    model = check_model(engine, body.model)
    await check_constraint(engine, constraint)
    structured = constraint[0] if constraint else None
    ids = await encode_chat(
        request,
        engine,
        body.messages,
        body.add_generation_prompt,
        body.template_kwargs,
        tools,
        chat_template=body.request_template,
        continue_final_message=body.continue_final_message,
    )
    ids = sampling.truncate_prompt(
        ids, body.truncate_prompt_tokens, body.truncation_side, engine.max_model_len
    )
    last = body.messages[-1]
    prompts = [Prompt(ids, last.text() if body.echo and last.role == "assistant" else "")]
    base = await request_params(engine, body, structured, model, len(ids))
    plan = sampling.plan(body)
    check_answer_size(body, plan, base, prompts, engine.max_model_len)
    rid, engine_rid = _ids("chatcmpl", body)
    log_caller(body, rid)
    fan = FanOut(
        engine,
        await sub_requests(engine, engine_rid, prompts, base, plan),
        body.stream,
        body.max_tokens_param,
        constraint[1] if constraint else None,
    )
    shape = ChatShape(
        body,
        {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model},
        prompts,
        TokenText(engine.tokenizer, body.return_tokens_as_token_ids),
    )
    shape.parse_tools = body.tools_active
    shape.tool_format = tool_call_format(api_settings.tool_call_parser)
    shape.reasoning_parser = api_settings.reasoning_parser
    if body.use_beam_search:
        limit = body.max_new_tokens or _room(engine, len(ids)) or 1
        return await beam_search.answer(request, engine, body, shape, prompts, [limit])
    return await serve_answer(request, fan, plan, shape, body.stream)
