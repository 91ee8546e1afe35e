"""The body of POST /v1/responses: OpenAI's Responses request, its stateless subset.

Honoured: `input` (text, or a list of items: messages, function_call, function_call_output, reasoning),
`instructions`, function `tools` (Responses' flat shape) and `tool_choice`, `parallel_tool_calls`,
`max_output_tokens`, `temperature`, `top_p`, `text.format` (json_schema / json_object), `reasoning.effort`,
`include` ("message.output_text.logprobs" with `top_logprobs`), `stream`, and `metadata` / `user` /
`service_tier` / `store` echoed. vLLM's extra sampling fields (top_k, seed, stop, ...) go to the chat
request as they are, which validates them (conversion.py).

Refused with a 400 naming the field (the server keeps no state between requests):
`previous_response_id`, `conversation`, `background`, `prompt` (stored prompt templates), `truncation`
"auto", `max_tool_calls`. `store: true` is accepted and answered with `"store": false`, as vLLM does
without its response store: nothing is kept, so a later request cannot refer to it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from graphcache.api.openai.body import RequestBody, SBool, SFloat, SInt, Text
from graphcache.api.openai.sampling_fields import MAX_LOGPROBS
from graphcache.engine.errors import InvalidRequest

__all__ = ["FORWARDED_FIELDS", "MAX_INPUT_ITEMS", "ResponsesRequest"]

MAX_INPUT_ITEMS = 1023  # the chat's own bound on messages (1024), less one for the instructions
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's

# vLLM's extra fields of its ResponsesRequest (and the chat fields they share): forwarded to the chat
# request under the same names, so its validation and refusals answer for them.
FORWARDED_FIELDS = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "bad_words",
    "structured_outputs",
    "chat_template_kwargs",
    "priority",
    "cache_salt",
    "kv_transfer_params",
    "vllm_xargs",
    "mm_processor_kwargs",
)

# Stateful features: field -> (accepted values, why anything else is refused).
_STATELESS = "this server keeps no responses between requests (the Responses API's stateless subset)"
_REFUSED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((None,), f"{_STATELESS}; send the earlier turns as input items instead"),
    "conversation": ((None,), f"{_STATELESS}; send the conversation's items as input instead"),
    "background": ((None, False), f"{_STATELESS}, so a background response could never be retrieved"),
    "prompt": ((None,), "stored prompt templates are not supported; send instructions and input"),
    "truncation": (
        (None, "disabled"),
        'only "disabled": cutting the start of a chat would drop its instructions; shorten the input',
    ),
    "max_tool_calls": ((None,), "not supported; set parallel_tool_calls false to get at most one call"),
}


class ResponsesRequest(RequestBody):
    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    input: Text | list[dict[str, Any]] = Field(
        ..., description="Text (one user message) or a list of input items."
    )
    instructions: Text | None = Field(None, description="A system message put before the input.")
    max_output_tokens: SInt | None = Field(None, ge=1, description="Default: the rest of max_model_len.")
    temperature: SFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: SFloat | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: SInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: SBool = False
    stream_options: dict[str, Any] | None = Field(None, description="Accepted; no obfuscation is sent.")
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: SBool = True
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "json_schema", ...}}')
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": "low" | ...}')
    include: list[Text] | None = Field(None, max_length=16)
    metadata: dict[str, Text] | None = Field(None, description="Echoed in the response.")
    user: str | None = Field(None, max_length=512, description="Written to the server log.")
    safety_identifier: str | None = Field(None, max_length=512, description="Written to the server log.")
    prompt_cache_key: str | None = Field(
        None, max_length=512, description="Accepted; the prefix cache is automatic."
    )
    prompt_cache_retention: Any = None
    service_tier: Text | None = Field(None, max_length=64, description='Echoed as "default".')
    store: SBool | None = Field(None, description='Accepted; nothing is stored ("store": false back).')
    request_id: str | None = Field(None, min_length=1, max_length=128, description="The response's id.")

    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    truncation: Any = None
    max_tool_calls: Any = None

    # FORWARDED_FIELDS: checked by the chat request they are passed on to.
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None
    priority: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    @property
    def logprobs(self) -> bool:
        """include "message.output_text.logprobs": the output text's tokens carry their logprobs."""
        return "message.output_text.logprobs" in (self.include or [])

    def check(self) -> None:
        """The stateful fields refused, metadata within OpenAI's bounds (InvalidRequest naming the field)."""
        for name, (accepted, why) in _REFUSED.items():
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) for a in accepted):
                raise InvalidRequest(f"{name} is not supported: {why}", param=name)
        if isinstance(self.input, list) and not 1 <= len(self.input) <= MAX_INPUT_ITEMS:
            raise InvalidRequest(f"input must hold 1 to {MAX_INPUT_ITEMS} items", param="input")
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequest("input must not be empty", param="input")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()
        ):
            raise InvalidRequest(
                f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys up to {MAX_METADATA_KEY} and "
                f"values up to {MAX_METADATA_VALUE} characters",
                param="metadata",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest(
                'top_logprobs needs include ["message.output_text.logprobs"]', param="top_logprobs"
            )
