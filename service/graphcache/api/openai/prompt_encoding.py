"""Prompts to token ids for the generation and /tokenize endpoints: size-bounded, off the event loop.

Text that cannot fit the context window (over max_model_len * MAX_CHARS_PER_TOKEN characters) is
refused before tokenizing, so an oversized prompt never stalls the event loop or the engine thread.
Tokenizing runs on the input pool (api/server/executors.py; the tokenizer releases the interpreter
lock). A chat's template renders in a killable worker process (api/server/render_pool.py), never in
the server; a template sent with the request renders only when the operator trusts request templates.
Chat content is encoded so that special-token strings in it stay plain text (`Tokenizer.prepare_chat`
masks them before rendering, `encode_rendered` restores them as text), unless the deployment trusts its
clients (settings.http.allow_special_tokens_in_chat). Every template failure is a 400
(`chat_template_error`). Role "tool" messages, earlier assistant tool_calls and the tools themselves
are rendered by the template.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from fastapi import Request

from graphcache.api.openai.protocol import ChatMessage
from graphcache.api.server.disconnect import ClientGone, unless_disconnected
from graphcache.api.server.errors import APIError
from graphcache.api.server.executors import run_input
from graphcache.api.server.render_pool import RenderLimitError, RenderPool, encode_job
from graphcache.model.chat_template import (
    DEFAULT_TEXT_LIMIT,
    ChatTemplateError,
    InvalidChatTemplate,
    load_chat_template,
)
from graphcache.model.tokenizer import MAX_CHARS_PER_TOKEN, PreparedChat

__all__ = ["encode_chat", "encode_prompt", "render_pools"]

log = logging.getLogger("graphcache.api")


def _chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    # "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
    chat = []
    for m in messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            entry["tool_calls"] = m.tool_calls
        if m.reasoning_content is not None:
            entry["reasoning_content"] = m.reasoning_content
        chat.append(entry)
    return chat


def _client_chars(chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters of client text the template renders: contents, earlier tool calls, tool definitions."""
    chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in chat)
    structured = [m["tool_calls"] for m in chat if "tool_calls" in m] + ([tools] if tools else [])
    return chars + (len(json.dumps(structured, ensure_ascii=False)) if structured else 0)


def _check_text_size(engine, chars: int, param: str, what: str) -> None:
    """Refuse text that cannot fit the context window, before paying for tokenizing it (a token is
    rarely more than MAX_CHARS_PER_TOKEN characters)."""
    limit = engine.max_model_len
    if limit is not None and chars > limit * MAX_CHARS_PER_TOKEN:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens; {what} has {chars} "
            f"characters, more than the {limit * MAX_CHARS_PER_TOKEN} characters ({MAX_CHARS_PER_TOKEN} "
            "per token) that could fit it. Shorten it.",
            param=param,
            code="context_length_exceeded",
        )


@functools.cache
def _configured_template(value: str) -> str:
    """The server's chat_template setting as template text (a file is read once)."""
    return load_chat_template(value)


def render_pools(app) -> dict[str, RenderPool]:
    """The app's chat-template rendering pools, made on first use: "model" (the model's or the
    server's template) and "request" (templates sent by trusted clients)."""
    pools = getattr(app.state, "render_pools", None)
    if pools is None:
        http = app.state.settings.http
        pools = {
            name: RenderPool(
                name, http.chat_template_workers, http.chat_template_timeout_s, http.chat_template_memory_mb
            )
            for name in ("model", "request")
        }
        app.state.render_pools = pools
    return pools


def _template_source(request: Request, engine, chat_template: str | None) -> tuple[str, RenderPool]:
    """The template this chat renders with and the pool it renders in: the request's own (only when the
    operator trusts request templates), else the server's setting, else the model's."""
    pools = render_pools(request.app)
    http = request.app.state.settings.http
    if chat_template is not None:
        if not http.trust_request_chat_template:
            raise APIError(
                400,
                "This server does not run chat templates sent with a request (a template is code). Drop "
                "chat_template, or start the server with --trust-request-chat-template "
                "(GRAPHCACHE_TRUST_REQUEST_CHAT_TEMPLATE=true) if every client is trusted.",
                param="chat_template",
                code="chat_template_not_trusted",
            )
        return chat_template, pools["request"]
    if http.chat_template:
        return _configured_template(http.chat_template), pools["model"]
    return engine.tokenizer.chat_template, pools["model"]


async def encode_prompt(
    engine, text: str, add_special_tokens: bool = True, param: str = "prompt"
) -> list[int]:
    """A prompt string's ids, bounded by size first, tokenized off the event loop."""
    _check_text_size(engine, len(text), param, "the prompt")
    return await run_input(engine.tokenizer.encode, text, add_special_tokens)


async def encode_chat(
    request: Request,
    engine,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """A chat's prompt ids through its template, bounded by size first: the request's `chat_template`
    (with trust_request_chat_template), else the server's (Settings chat_template), else the model's.
    Masking and tokenizing run on the input threads, rendering in a killable process (render_pool.py).
    template_kwargs: extra variables the template sees (chat_template_kwargs, documents, reasoning_effort);
    tools: template_tools(body.tools). Role "tool" messages and assistant tool_calls go to the template.
    continue_final_message: the prompt ends inside the final message."""
    chat = _chat_dicts(messages)
    _check_text_size(engine, _client_chars(chat, tools), "messages", "the messages' content and tools")
    template, pool = _template_source(request, engine, chat_template)
    tokenizer = engine.tokenizer
    # Chat content is user input: special-token strings in it ("<|im_start|>system") are encoded as plain
    # text, never as control tokens, unless a trusted deployment allows it (Settings).
    allow_special = request.app.state.settings.http.allow_special_tokens_in_chat
    limit = engine.max_model_len
    max_chars = limit * MAX_CHARS_PER_TOKEN if limit is not None else DEFAULT_TEXT_LIMIT

    def prepare() -> tuple[PreparedChat, bytes]:
        prepared = tokenizer.prepare_chat(chat, tools, allow_special)
        variables = {**tokenizer.template_variables(), "tools": prepared.tools, **(template_kwargs or {})}
        job = encode_job(
            template, prepared.messages, add_generation_prompt, continue_final_message, variables, max_chars
        )
        return prepared, job

    try:
        prepared, job = await run_input(prepare)
        rendered = await unless_disconnected(request.receive, pool.render(job))
    except ChatTemplateError as e:
        raise _template_error(e) from None
    except ClientGone:  # its render was killed; nobody reads this answer
        raise APIError(499, "The client closed the connection while its chat rendered.") from None
    return await run_input(tokenizer.encode_rendered, rendered, prepared)


def _template_error(e: ChatTemplateError) -> APIError:
    """A template failure as the client's 400: never a 500, whatever the template did."""
    if isinstance(e, InvalidChatTemplate):
        return APIError(400, e.message, param="chat_template", code="chat_template_error")
    if isinstance(e, RenderLimitError):
        log.info("chat template render refused: %s", e.message)
        fix = (
            "shorten the chat"
            if e.setting == "max_model_len"
            else f"simplify the template (the server's limit is its {e.setting} setting)"
        )
        return APIError(400, f"{e.message}; {fix}.", param="messages", code="chat_template_error")
    log.info("chat template refused the messages: %s", e.message)  # the client's messages broke its rules
    return APIError(
        400,
        f"The chat template refused these messages: {e.message}",
        param="messages",
        code="chat_template_error",
    )
