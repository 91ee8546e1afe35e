"""Request bodies of the OpenAI-compatible generation endpoints, /v1/completions and /v1/chat/completions.

Nothing is silently ignored. Every field of vLLM's CompletionRequest and ChatCompletionRequest is
declared, here or in the shared base (api/openai/sampling_fields.py), and either honoured (api/openai/sampling.py
maps it into SamplingParams or the prompt) or refused: api/openai/refused_fields.py lists the fields whose
non-default values graphcache cannot honour, each with the reason the 400 gives. A field unknown to
both OpenAI and vLLM is accepted and logged once per name, as vLLM does (api/openai/body.py).

`null` means "the default" for every optional field (temperature, top_p, n, stream, penalties, ...).
Numbers are strict (no "5" for 5, no true for 1): a wrong JSON type is a 400, not a silent conversion.
Checks across fields that need a `param` (best_of >= n, the sequence limit, one structured-output
constraint: api/openai/constraints.py) are `check()` methods raising InvalidRequest; checks that need the
engine are in openai.py (model name), sampling.py (tokenizing) and EngineCore.check (prompt length,
max_tokens, vocabulary). The bodies of /admin/warmup, /tokenize and /detokenize are in
api/openai/utility_requests.py.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import Field, field_validator

from graphcache.api.openai import tool_calls
from graphcache.api.openai.body import RequestBody, SBool, SInt, Text
from graphcache.api.openai.refused_fields import REFUSED_CHAT, REFUSED_COMPLETION, refusing
from graphcache.api.openai.sampling_fields import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_SEQUENCES_PER_REQUEST,
    MAX_STOP,
    SamplingFields,
    StreamOptions,
)
from graphcache.engine.errors import InvalidRequest

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOGPROBS",
    "MAX_SEQUENCES_PER_REQUEST",
    "MAX_STOP",
    "REFUSED_CHAT",
    "REFUSED_COMPLETION",
    "RESERVED_TEMPLATE_KWARGS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "TextPart",
]

# /v1/completions, also for an explicit "max_tokens": null (as OpenAI, vLLM)
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    prompt: Text | list[SInt] | list[Text] | list[list[SInt]] = Field(
        ..., description="A string, a list of token ids, or a batch (a list of either)."
    )
    max_tokens: SInt = Field(
        DEFAULT_COMPLETION_MAX_TOKENS,
        ge=0,
        description=f"Tokens to generate (null or absent: {DEFAULT_COMPLETION_MAX_TOKENS}); "
        "prompt + max_tokens <= max_model_len. 0 only with echo: the prompt back (with its logprobs if asked).",
    )
    echo: SBool = Field(False, description="Prepend the prompt to the text (and its logprobs to logprobs).")
    logprobs: SInt | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Logprobs of the sampled token + top k."
    )
    add_special_tokens: SBool = Field(True, description="Add the model's BOS to a text prompt.")
    prompt_embeds: Any = None
    suffix: Any = ""

    refuse_non_defaults = refusing(REFUSED_COMPLETION)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        """Always a list of prompts, each a string or a list of ids, none empty."""
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if not v or any(len(p) == 0 for p in batch):
            raise ValueError("prompt must not be empty (nor any prompt of a batch)")
        return batch

    @property
    def prompts(self) -> list[str | list[int]]:
        return cast("list[str | list[int]]", self.prompt)  # normalized to a batch by _prompts

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only with echo, to get the prompt back)", param="max_tokens"
            )
        self._check_common(len(self.prompts))


class TextPart(RequestBody):
    type: Literal["text"]
    text: Text


# A custom role (vLLM passes any role through to the chat template, which decides what it means): a
# short name, so it cannot carry a second message's worth of text past the content bounds.
MAX_ROLE_CHARS = 64


class ChatMessage(RequestBody):
    role: Text = Field(
        ...,
        min_length=1,
        max_length=MAX_ROLE_CHARS,
        description='"system", "developer", "user", "assistant", "tool", or a custom role the chat template renders.',
    )
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(None, max_length=512, description="Passed to the chat template.")
    tool_call_id: Text | None = Field(None, max_length=512, description='The call a "tool" message answers.')
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant message's earlier calls.")
    reasoning_content: Text | None = Field(
        None, description="An assistant message's earlier reasoning, for templates that render it (Qwen3)."
    )

    @field_validator("tool_calls")
    @classmethod
    def _renderable_calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if v is None else tool_calls.check_history_calls(v)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# Names the chat template sees that a request's chat_template_kwargs must not replace (or that would
# reach encode_chat as its own options, e.g. the special-token guard).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "template",
        "allow_special_in_content",
        "tokenize",
        "bos_token",
        "eos_token",
        "pad_token",
        "tools",
        "raise_exception",
        "strftime_now",
    }
)


def request_template(chat_template: str | None, kwargs: dict[str, Any] | None) -> str | None:
    """A chat's own template: chat_template, or chat_template_kwargs' "chat_template" (vLLM takes both)."""
    return chat_template or (kwargs or {}).get("chat_template")


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs as the template's variables: all but the request's own template."""
    return {k: v for k, v in (kwargs or {}).items() if k != "chat_template"}


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: template variable names, none of them one the server sets. "chat_template"
    is the request's template (vLLM's other spelling of the chat_template field); it must be text."""
    if v is not None:
        clash = sorted(k for k in v if k in RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise ValueError(f"{', '.join(clash)}: reserved names, set by the server; rename them")
        if not all(k.isidentifier() for k in v):
            raise ValueError("keys must be identifiers (template variable names)")
        if not isinstance(v.get("chat_template", ""), str):
            raise ValueError("chat_template must be a jinja template (text)")
    return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_tokens: SInt | None = Field(
        None, ge=1, description="Deprecated OpenAI name of max_completion_tokens."
    )
    max_completion_tokens: SInt | None = Field(None, ge=1, description="Default: the rest of max_model_len.")
    logprobs: SBool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: SInt = Field(0, ge=0, le=MAX_LOGPROBS, description="With logprobs: the k most likely too.")
    echo: SBool = Field(False, description="Prepend the last message's content if it is the assistant's.")
    add_generation_prompt: SBool = Field(
        True, description="End the prompt with the assistant turn's opening."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template."
    )
    documents: list[dict[str, str]] | None = Field(
        None, description="The template's `documents` variable (RAG)."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="The template's `reasoning_effort` variable."
    )
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: SBool = True
    continue_final_message: SBool = Field(
        False,
        description="End the prompt inside the final message (no end of turn) so the model continues it; "
        "needs add_generation_prompt false.",
    )
    chat_template: Text | None = Field(
        None, description="A jinja chat template for this request (instead of the server's or model's)."
    )
    add_special_tokens: Any = False
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    include_reasoning: Any = True
    return_prompt_text: Any = False

    refuse_non_defaults = refusing(REFUSED_CHAT)

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @property
    def request_template(self) -> str | None:
        return request_template(self.chat_template, self.chat_template_kwargs)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def engine_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (vLLM passes documents and reasoning_effort the same way)."""
        extra = template_variables(self.chat_template_kwargs)
        if self.documents is not None:
            extra.setdefault("documents", self.documents)
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        return extra

    def check(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt false",
                param="continue_final_message",
            )
        self._check_common(1)
        found = self.structured_constraints()
        if self.tools_active and found:
            raise InvalidRequest(
                f"tools and {found[0][0]} both constrain the output: send one of them (or "
                'tool_choice "none" to only show the tools to the model)',
                param=found[0][0],
            )

    @property
    def tools_active(self) -> bool:
        """Tools were given and may be called (tool_choice is not "none"): the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"
