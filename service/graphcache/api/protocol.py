"""Request bodies of the OpenAI-compatible API and the admin endpoints, as pydantic models.

Numbers are strict (no "5" for 5, no true for 1): a wrong JSON type is a 400, not a silent
conversion. Unknown fields are ignored, like OpenAI's own server does for forward
compatibility; known fields whose non-default values graphcache cannot honour (n > 1,
logprobs, echo, ...) are rejected with a message rather than silently dropped.
Checks that need the engine: the model name in openai.py; prompt length, max_tokens and vocabulary in
EngineCore.check (engine/core.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "StreamOptions",
    "TokenizeRequest", "WarmupRequest",
]

SInt = Annotated[int, Strict()]
SFloat = Annotated[float, Strict()]  # strict float still takes JSON integers (1 -> 1.0)
SBool = Annotated[bool, Strict()]


def _encodable(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); the tokenizer cannot encode them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains invalid Unicode (a lone surrogate); send valid UTF-8") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]

MAX_STOP = 4
MAX_STOP_CHARS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16   # /v1/completions, also for an explicit "max_tokens": null (as OpenAI, vLLM)
MAX_SEED = 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: SBool = False


class _SamplingFields(_Body):
    """Fields shared by both generation endpoints."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    temperature: SFloat = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: SFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: SInt = Field(-1, ge=-1, description="Extension: keep the k most likely tokens; -1 or 0 = off.")
    seed: SInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = Field(None, description=f"Up to {MAX_STOP} stop strings.")
    stop_token_ids: list[SInt] | None = Field(None, max_length=64, description="Extension: stop on these ids.")
    ignore_eos: SBool = Field(False, description="Extension: keep generating past end-of-sequence tokens.")
    n: SInt = Field(1, description="Only 1 is supported.")
    stream: SBool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: SFloat = 0.0
    frequency_penalty: SFloat = 0.0
    user: str | None = Field(None, max_length=512)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1-{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported; send one request per completion")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; leave them at 0")
        return v

    @model_validator(mode="after")
    def _no_stream_options_without_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[SInt] | list[Text] | list[list[SInt]] = Field(
        ..., description="A string or a list of token ids. Batches (lists of prompts) of more than one are refused.")
    max_tokens: SInt | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1,
                                    description=f"Tokens to generate (null or absent: {DEFAULT_COMPLETION_MAX_TOKENS}); "
                                                "prompt + max_tokens <= max_model_len.")
    echo: SBool = False
    best_of: SInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        # A one-element batch is the same request as its element; more is a batch we do not split.
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _null_is_default(cls, v: int | None) -> int:
        # null means "the default", not "the rest of the context" (that is chat's default only).
        return DEFAULT_COMPLETION_MAX_TOKENS if v is None else v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; leave it unset or 1")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported; leave logprobs unset")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_tokens: SInt | None = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: SInt | None = Field(None, ge=1, description="Default: the rest of max_model_len.")
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logprobs not in (None, False):
            raise ValueError("logprobs are not supported; leave logprobs unset")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format type 'text' is supported")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class WarmupRequest(_Body):
    """POST /admin/warmup: uniform-decode sizes and/or descriptors "T:R" / "T:R:decode", or a profile
    (GET /admin/cache/profile's output), or nothing (no body, {}): the configured warmup again."""

    sizes: list[SInt] = Field(default_factory=list, max_length=512,
                              description="Uniform-decode batch sizes to capture (each a capture size).")
    descriptors: list[str] = Field(default_factory=list, max_length=512,
                                   description='Descriptors to capture: "TOKENS:REQS" or "TOKENS:REQS:decode".')
    profile: dict[str, Any] | None = Field(
        None, description='A profile as GET /admin/cache/profile exports it: {"version": 1, "descriptors": '
        '[{"descriptor": "T:R[:decode]", ...}]}; its descriptors are captured.')

    @model_validator(mode="after")
    def _one_form(self):
        if self.profile is not None and (self.sizes or self.descriptors):
            raise ValueError('give "profile", or "sizes" and/or "descriptors", not both')
        return self

    @property
    def configured(self) -> bool:
        """Nothing given: re-run the configured warmup (settings or GRAPHCACHE_WARMUP_PROFILE)."""
        return self.profile is None and not self.sizes and not self.descriptors


class TokenizeRequest(_Body):
    """POST /tokenize, vLLM's two forms: `prompt` (+ add_special_tokens) or chat `messages` (+
    add_generation_prompt), tokenized exactly as /v1/completions and /v1/chat/completions would."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    prompt: Text | None = Field(None, description="Text to tokenize (the completions form).")
    add_special_tokens: SBool | None = Field(
        None, description="Prompt form: add the model's BOS/EOS as /v1/completions does (default true).")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024,
                                               description="A chat to render with the model's template and tokenize.")
    add_generation_prompt: SBool = Field(True, description="Chat form: end with the assistant turn's opening.")
    continue_final_message: SBool = False
    return_token_strs: SBool = False
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give either "prompt" (text) or "messages" (a chat), not both')
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to prompt only: a chat template writes its own special tokens")
        if self.continue_final_message:
            raise ValueError("continue_final_message is not supported; leave it false")
        if self.return_token_strs:
            raise ValueError("return_token_strs is not supported; detokenize ids with POST /detokenize")
        if self.tools:
            raise ValueError("tools are not supported")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text (special tokens included, as vLLM does)."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    tokens: list[SInt] = Field(..., description="Token ids, each in the model's vocabulary; at most max_model_len.")
