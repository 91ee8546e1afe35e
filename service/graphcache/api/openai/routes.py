"""OpenAI-compatible generation: /v1/completions, /v1/chat/completions, /v1/models.

A request is validated (protocol.py: every field of vLLM's requests is honoured or refused with a 400
naming it), bounded by size (text over max_model_len * MAX_CHARS_PER_TOKEN characters is refused before
tokenizing), tokenized (prompt_encoding.py: off the event loop, by calls that release the interpreter lock,
so neither the loop nor the engine thread stalls), turned into one engine request per sequence (sampling.py,
fanout.py: n, best_of and batched prompts), its answer's size bounded (answer_size.py: a 400 past
MAX_ANSWER_BYTES, before anything runs), checked against the engine's limits, then submitted.
Chat content is encoded so that special-token strings in it stay plain text (`Tokenizer.encode_chat`);
a chat template's `raise_exception` is a 400 on "messages". Tools (OpenAI function tools), role "tool"
messages and earlier assistant tool_calls are rendered by the template; tool_choice "required" or a
named function becomes a grammar forcing the call markup (api/openai/tool_calls.py), and the answer's text is
parsed back into `tool_calls` (streams: per-choice deltas, choices.py). An output constraint
(response_format, guided_*, structured_outputs, a tool_choice grammar) is compiled off the event loop
before submitting, so an invalid schema, regex or grammar is a 400 naming the field it came in.
Every sequence's first output is awaited
before any byte is sent, so a full queue or a draining engine is a clean 429/503 with a status code
even for streams. After that, a stream is SSE (`data: <json>\n\n`, last `data: [DONE]`), each choice's
chunks carrying its index. A client that goes away, streaming or not, aborts its requests so the
engine frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.responses import Response

from graphcache.api.openai import beam_search, constraints, sampling, token_ids, tool_calls
from graphcache.api.openai.answer_size import check_answer_size
from graphcache.api.openai.choices import ChatShape, CompletionShape, Prompt
from graphcache.api.openai.fanout import FanOut, Sampled, Sub, best_of, prompt_usage, usage
from graphcache.api.openai.logprobs import TokenText
from graphcache.api.openai.prompt_encoding import encode_chat, encode_prompt
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.openai.tool_parsers import tool_call_format
from graphcache.api.server import answer_json
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError, api_error_for, error_body
from graphcache.api.server.executors import run_input, run_response
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.sequence import StructuredSpec, TokenIds

# encode_chat / encode_prompt live in prompt_encoding.py; re-exported for callers that import them from here.
__all__ = [
    "check_body",
    "check_constraint",
    "encode_chat",
    "encode_prompt",
    "forced_tool_spec",
    "log_caller",
    "model_card",
    "model_cards",
    "observe_n",
    "output_constraint",
    "request_params",
    "router",
    "sub_requests",
    "template_tools",
]

log = logging.getLogger("graphcache.api")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])

# --------------------------------------------------------------------------- tools and output constraints


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` as the chat template gets them, checked (a 400 naming "tools" otherwise): plain dicts
    without null fields at the tool and function level (a template would print them as "None")."""
    if not tools:
        return None
    try:
        tool_calls.check_tools(tools)
    except InvalidRequest as e:
        raise api_error_for(e) from None
    out = []
    for tool in tools:
        fn = {k: v for k, v in tool["function"].items() if v is not None}
        out.append({**{k: v for k, v in tool.items() if v is not None}, "function": fn})
    return out


def forced_tool_spec(body: ChatCompletionRequest, tool_call_parser: str = "hermes") -> StructuredSpec | None:
    """The constraint tool_choice puts on the output: "required" or a named function force the call
    markup (api/openai/tool_calls.py); "auto", "none" or no tools constrain nothing."""
    if not body.tools_active:
        return None
    try:
        return tool_calls.tool_choice_spec(
            body.tools, body.tool_choice, body.parallel_tool_calls, tool_call_format(tool_call_parser)
        )
    except InvalidRequest as e:
        raise api_error_for(e) from None


def output_constraint(
    body, tool_spec: StructuredSpec | None = None, compact_default: bool = False
) -> tuple[StructuredSpec, str] | None:
    """The output constraint and the field the client set it with (a tool_choice's grammar holds the
    tools' parameter schemas: "tools"). The body's check() already refused two constraints at once.
    JSON is compact as the request's disable_any_whitespace says, else as the server's default."""
    if tool_spec is not None:
        return tool_spec, "tools"
    try:
        found = body.structured_constraints()
        own = constraints.disable_any_whitespace(body.structured_outputs)
    except InvalidRequest as e:
        raise api_error_for(e) from None
    if not found:
        return None
    param, kind, value = found[0]
    compact = (compact_default if own is None else own) and kind in constraints.JSON_KINDS
    return StructuredSpec(kind, value, compact), param


def _compile(engine, spec: StructuredSpec, param: str) -> None:
    checker = engine.checker
    if checker is None:  # the engine stopped meanwhile: generate() refuses the request
        return
    checker.structured.check(spec, param)  # the compiler is built once, under the checker's lock


async def check_constraint(engine, constraint: tuple[StructuredSpec, str] | None) -> None:
    """Compile the constraint off the event loop (a large schema takes ~100 ms; the compiler's first
    build ~1 s): an invalid schema, regex or grammar is a 400 naming the field the client used. The
    compiled grammar is cached, so the engine's own check at submit is a cache hit."""
    if constraint is None:
        return
    try:  # grammar compiling's own bounded pool belongs in api/server/executors.py, beside run_input/run_response
        await asyncio.to_thread(_compile, engine, *constraint)
    except InvalidRequest as e:
        raise api_error_for(e) from None


# --------------------------------------------------------------------------- end of tools and constraints


# --------------------------------------------------------------------------- engine access


def serving_engine(request: Request):
    """The engine, if it may take a request now; else the 503 that says why."""
    engine = request.app.state.engine
    refused = engine.refusal()
    if refused is not None:
        raise api_error_for(refused)
    return engine


def generating_engine(request: Request, endpoint: str):
    """serving_engine for a generation endpoint: an embedding model answers it with a 400 naming the flag (vLLM
    answers that the model does not support the API)."""
    engine = serving_engine(request)
    if getattr(engine, "embedding", None) is not None:
        raise APIError(
            400,
            f"The model '{engine.model_name}' is served as an embedding model and answers /v1/embeddings, not "
            f"{endpoint}; serve a generation model, or this checkpoint with --runner generate.",
            param="model",
        )
    return engine


def check_model(engine, name: str | None) -> str:
    """The served model's name, or a LoRA adapter's (--enable-lora); another name is a 404
    `model_not_found`, as OpenAI and vLLM answer."""
    adapters = engine.lora_modules
    if adapters is not None and name is not None and name in adapters:
        return name
    if name is not None and name != engine.model_name:  # the caller's name is not echoed back
        raise APIError(
            404,
            f"The requested model does not exist; this server serves '{engine.model_name}' (GET /v1/models).",
            param="model",
            code="model_not_found",
            type="invalid_request_error",
        )
    return engine.model_name


def model_cards(request: Request) -> list[dict]:
    """GET /v1/models' entries: the served model, then its LoRA adapters (--enable-lora)."""
    engine = request.app.state.engine
    cards = [model_card(request)]
    if engine.lora_modules is not None:
        for adapter in engine.lora_modules.all():
            parent = adapter.base_model_name or engine.model_name
            cards.append(model_card(request, adapter.name, adapter.path, parent))
    return cards


def model_card(request: Request, model_id: str | None = None, root: str | None = None, parent=None) -> dict:
    """The served model (or an adapter of it: its id, path and base model) as OpenAI's model object."""
    engine = request.app.state.engine
    created = request.app.state.started
    model_id = model_id or engine.model_name
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "graphcache",
        # vLLM's card: root is the checkpoint served (the model id where no path is configured), parent
        # the base model of an adapter (None for the base model), permission one open ModelPermission.
        "root": root or str(request.app.state.settings.model.path or engine.model_name),
        "parent": parent,
        "max_model_len": engine.max_model_len if engine.ready else None,
        # The sampling defaults a request gets for the fields it leaves out (--generation-config: the
        # model's generation_config.json by default); {} = the API's own; null until the model is loaded.
        "generation_defaults": dict(engine.generation_defaults) if engine.ready else None,
        "permission": [
            {
                "id": f"modelperm-{model_id}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


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


async def _serve(
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
    return await _serve(request, fan, plan, shape, body.stream)


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
    return await _serve(request, fan, plan, shape, body.stream)
