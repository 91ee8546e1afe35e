"""Request bodies of the endpoints that do not generate: POST /admin/warmup (admin.py), POST /tokenize
and POST /detokenize (tools.py).

They share the generation bodies' rules (api/openai/body.py: strict numbers, null = default, unknown fields
logged); /tokenize takes the same prompt and chat forms as /v1/completions and /v1/chat/completions.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from graphcache.api.openai.body import FieldError, RequestBody, SBool, SInt, Text
from graphcache.api.openai.protocol import (
    ChatMessage,
    check_template_kwargs,
    request_template,
    template_variables,
)

__all__ = ["DetokenizeRequest", "TokenizeRequest", "WarmupRequest"]


class WarmupRequest(RequestBody):
    """POST /admin/warmup: uniform-decode sizes and/or descriptors "T:R" / "T:R:decode", or a profile
    (GET /admin/cache/profile's output, under "profile" or posted bare), or nothing (no body, {}): the
    configured warmup again."""

    sizes: list[SInt] = Field(
        default_factory=list,
        max_length=512,
        description="Uniform-decode batch sizes to capture (each a capture size).",
    )
    descriptors: list[str] = Field(
        default_factory=list,
        max_length=512,
        description='Descriptors to capture: "TOKENS:REQS" or "TOKENS:REQS:decode" (":lora" last: the LoRA '
        "variant, with --enable-lora).",
    )
    profile: dict[str, Any] | None = Field(
        None,
        description='A profile as GET /admin/cache/profile exports it: {"version": 1, "descriptors": '
        '[{"descriptor": "T:R[:decode]", ...}]}; its descriptors are captured.',
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_profile(cls, data: Any) -> Any:
        """An exported profile posted as it is ({"version": 1, "descriptors": [{"descriptor": ...}]}, what
        GET /admin/cache/profile returns) is taken as {"profile": <it>}: the configured warmup in its place
        would be a silent wrong action. Recognised by its "version" or by descriptors that are objects."""
        if not isinstance(data, dict) or "profile" in data or "sizes" in data:
            return data
        items = data.get("descriptors")
        if "version" in data or (isinstance(items, list) and any(isinstance(i, dict) for i in items)):
            return {"profile": data}
        return data

    @model_validator(mode="after")
    def _one_form(self):
        if self.profile is not None and (self.sizes or self.descriptors):
            raise FieldError('give "profile", or "sizes" and/or "descriptors", not both', param="profile")
        return self

    @property
    def configured(self) -> bool:
        """Nothing given: re-run the configured warmup (settings or GRAPHCACHE_WARMUP_PROFILE)."""
        return self.profile is None and not self.sizes and not self.descriptors


class TokenizeRequest(RequestBody):
    """POST /tokenize, vLLM's two forms: `prompt` (+ add_special_tokens) or chat `messages` (+
    add_generation_prompt, continue_final_message), tokenized exactly as /v1/completions and
    /v1/chat/completions would; return_token_strs adds each id's vocabulary string."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    prompt: Text | None = Field(None, description="Text to tokenize (the completions form).")
    add_special_tokens: SBool | None = Field(
        None,
        description="Add the tokenizer's special tokens (BOS, and EOS where it adds one) around the ids: "
        "prompt form default true (as /v1/completions); messages form default false, true adding them on top "
        "of what the chat template writes (vLLM's meaning).",
    )
    messages: list[ChatMessage] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="A chat to render with the model's template and tokenize.",
    )
    add_generation_prompt: SBool = Field(
        True, description="Chat form: end with the assistant turn's opening."
    )
    continue_final_message: SBool = Field(
        False,
        description="Chat form: end inside the final message (no end of turn), as /v1/chat/completions; "
        "needs add_generation_prompt false.",
    )
    return_token_strs: SBool = Field(
        False, description='Also return `token_strs`: each id\'s vocabulary string ("Ġworld"), as vLLM.'
    )
    chat_template: Text | None = Field(
        None,
        description="Chat form: a jinja chat template for this request (needs trust_request_chat_template).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Chat form: extra variables for the chat template."
    )

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @property
    def request_template(self) -> str | None:
        return request_template(self.chat_template, self.chat_template_kwargs)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return template_variables(self.chat_template_kwargs)

    tools: list[dict[str, Any]] | None = Field(
        None,
        max_length=128,
        description="Chat form: OpenAI function tools, "
        "rendered by the template as /v1/chat/completions does.",
    )

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise FieldError(
                'give either "prompt" (text) or "messages" (a chat), not both',
                param="messages" if self.messages is not None else "prompt",
            )
        if self.continue_final_message and self.messages is None:
            raise FieldError(
                "continue_final_message applies to the messages form only; send messages, or drop it",
                param="continue_final_message",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(
                "continue_final_message and add_generation_prompt cannot both be true; "
                "set add_generation_prompt false",
                param="continue_final_message",
            )
        if self.tools and self.messages is None:
            raise FieldError(
                "tools apply to the messages form only; send messages, or drop tools", param="tools"
            )
        for name in ("chat_template", "chat_template_kwargs"):
            if getattr(self, name) is not None and self.messages is None:
                raise FieldError(
                    f"{name} applies to the messages form only; send messages, or drop it", param=name
                )
        return self


class DetokenizeRequest(RequestBody):
    """POST /detokenize: token ids back to text (special tokens included, as vLLM does)."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    tokens: list[SInt] = Field(
        ..., description="Token ids, each in the model's vocabulary; at most max_model_len."
    )
