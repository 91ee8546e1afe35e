"""The `response` object of /v1/responses and its output items, built from a chat answer.

A chat choice's message (api/openai/choices.py: reasoning split off by the reasoning parser, tool calls
parsed by the tool-call parser) becomes, in this order: a `reasoning` item (when there was reasoning),
a `message` item with one `output_text` part (when there was text), and one `function_call` item per
call. A choice cut by max_output_tokens makes the response "incomplete" with incomplete_details
{"reason": "max_output_tokens"}, its last item "incomplete"; a call cut inside its arguments is left
out, as OpenAI and vLLM leave it (an agent must not run half a call). The stream (events.py) builds the
same items one delta at a time; there a cut call was announced already and ends "incomplete".
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from graphcache.api.openai.responses.protocol import ResponsesRequest

__all__ = [
    "ResponseHead",
    "call_item",
    "finish_status",
    "message_item",
    "new_item_id",
    "output_items",
    "reasoning_item",
    "response_usage",
]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str | None, logprobs: list[dict] | None = None, status: str = "completed"
) -> dict[str, Any]:
    content = [output_text(text, logprobs)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def finish_status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(the response's status, its incomplete_details): a choice cut by its token limit is incomplete."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(
    message: dict[str, Any], logprobs: dict | None, finish_reason: str | None
) -> list[dict[str, Any]]:
    """A whole chat choice's message (and its logprobs) as output items."""
    items = []
    last = "incomplete" if finish_reason == "length" else "completed"
    if message.get("reasoning"):
        items.append(reasoning_item(new_item_id("rs"), message["reasoning"]))
    if message.get("content"):
        content = (logprobs or {}).get("content")
        items.append(message_item(new_item_id("msg"), message["content"], content))
    calls = message.get("tool_calls") or []
    if finish_reason == "length" and calls and not _whole_object(calls[-1]["function"]["arguments"]):
        calls = calls[:-1]  # cut inside its arguments: never hand an agent half a call to run
    for call in calls:
        fn = call["function"]
        items.append(call_item(new_item_id("fc"), call["id"], fn["name"], fn["arguments"]))
    if items and last != "completed":
        items[-1]["status"] = last
    return items


def _whole_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def response_usage(chat_usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """The chat's usage in the Responses shape (input/output tokens, cached and reasoning tokens)."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, chat_usage["completion_tokens"])},
        "total_tokens": chat_usage["total_tokens"],
    }


@dataclass
class ResponseHead:
    """What every `response` object of one request carries: its id, time, model and the request's
    settings echoed (the sampling values the engine used for temperature and top_p)."""

    id: str
    model: str
    body: ResponsesRequest
    temperature: float
    top_p: float
    created_at: int = 0

    def __post_init__(self) -> None:
        self.created_at = self.created_at or int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: dict[str, str] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        reasoning = body.reasoning or {}
        text = dict(body.text or {})
        text.setdefault("format", {"type": "text"})
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "service_tier": "default",
            "store": False,
            "temperature": self.temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs or 0,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
        }
