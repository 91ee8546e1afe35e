"""Prompts to token ids for the generation and /tokenize endpoints: size-bounded, off the event loop.

Text that cannot fit the context window (over max_model_len * MAX_CHARS_PER_TOKEN characters) is
refused before tokenizing, so an oversized prompt never stalls the event loop or the engine thread.
Tokenizing runs on the input pool (api/executors.py; the tokenizer releases the interpreter lock). Chat content is
encoded so that special-token strings in it stay plain text (`Tokenizer.encode_chat`), unless the
deployment trusts its clients (settings.http.allow_special_tokens_in_chat); a chat template's
`raise_exception` is a 400 on "messages". Role "tool" messages, earlier assistant tool_calls and the
tools themselves are rendered by the template.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from fastapi import Request

from graphcache.api.errors import APIError
from graphcache.api.executors import run_input
from graphcache.api.protocol import ChatMessage
from graphcache.model.chat_template import ChatTemplateError, InvalidChatTemplate, load_chat_template
from graphcache.model.tokenizer import MAX_CHARS_PER_TOKEN

__all__ = ["encode_chat", "encode_prompt"]

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
        chat.append(entry)
    return chat


def _client_chars(chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """Characters of client text the template renders: contents, earlier tool calls, tool definitions."""
    chars = sum(len(m["content"]) for m in chat)
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
    """A chat's prompt ids through its template, bounded by size first, off the event loop: the
    request's `chat_template`, else the server's (Settings chat_template), else the model's.
    template_kwargs: extra variables the template sees (chat_template_kwargs, documents, reasoning_effort);
    tools: template_tools(body.tools). Role "tool" messages and assistant tool_calls go to the template.
    continue_final_message: the prompt ends inside the final message."""
    chat = _chat_dicts(messages)
    _check_text_size(engine, _client_chars(chat, tools), "messages", "the messages' content and tools")
    if chat_template is None and (configured := request.app.state.settings.http.chat_template):
        chat_template = _configured_template(configured)
    # Chat content is user input: special-token strings in it ("<|im_start|>system") are encoded as plain
    # text, never as control tokens, unless a trusted deployment allows it (Settings).
    allow_special = request.app.state.settings.http.allow_special_tokens_in_chat
    try:
        # The template has its own BOS; content's special-token strings stay plain text.
        return await run_input(
            engine.tokenizer.encode_chat,
            chat,
            add_generation_prompt,
            allow_special_in_content=allow_special,
            tools=tools,
            template=chat_template,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except InvalidChatTemplate as e:
        raise APIError(400, e.message, param="chat_template", code="chat_template_error") from None
    except ChatTemplateError as e:  # the client's messages broke the template's rules: one line, no traceback
        log.info("chat template refused the messages: %s", e.message)
        raise APIError(
            400,
            f"The chat template refused these messages: {e.message}",
            param="messages",
            code="chat_template_error",
        ) from None
