"""Request bodies of the OpenAI-compatible API and the admin endpoints, as pydantic models.

Nothing is silently ignored. Every field of vLLM's CompletionRequest and ChatCompletionRequest is
declared here and either honoured (api/sampling.py maps it into SamplingParams or the prompt) or
refused: `REFUSED_*` lists the fields whose non-default values graphcache cannot honour, each with
the reason the 400 gives. A field unknown to both OpenAI and vLLM is accepted and logged once per
name, as vLLM does (a newer client's field must not break an older server).

`null` means "the default" for every optional field (temperature, top_p, n, stream, penalties, ...).
Numbers are strict (no "5" for 5, no true for 1): a wrong JSON type is a 400, not a silent conversion.
Checks across fields that need a `param` (best_of >= n, the sequence limit, one structured-output
constraint) are `check()` methods raising InvalidRequest; checks that need the engine are in openai.py
(model name), sampling.py (tokenizing) and EngineCore.check (prompt length, max_tokens, vocabulary).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from graphcache.engine.errors import InvalidRequest

__all__ = [
    "MAX_LOGPROBS", "MAX_SEQUENCES_PER_REQUEST", "MAX_STOP", "REFUSED_CHAT", "REFUSED_COMPLETION",
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "StreamOptions",
    "TokenizeRequest", "WarmupRequest",
]

log = logging.getLogger("graphcache.api")

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

MAX_STOP = 64
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20                   # logprobs / top_logprobs / prompt_logprobs, as OpenAI
MAX_SEQUENCES_PER_REQUEST = 128     # prompts x max(n, best_of): each is one engine request
MAX_BAD_WORDS = 128
MAX_LOGIT_BIAS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16   # /v1/completions, also for an explicit "max_tokens": null (as OpenAI, vLLM)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SEED = INT64_MAX
MAX_UNKNOWN_NAMES_LOGGED = 256       # a client sending random names must not grow the set forever

_unknown_logged: set[str] = set()


def _log_unknown(model: str, name: str) -> None:
    if name in _unknown_logged or len(_unknown_logged) >= MAX_UNKNOWN_NAMES_LOGGED:
        return
    _unknown_logged.add(name)
    log.warning("field %r of %s is neither OpenAI's nor vLLM's; it is accepted and has no effect "
                "(logged once per name)", name[:64], model)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default_and_log_unknown(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in data:
            if name not in cls.model_fields:
                _log_unknown(cls.__name__, str(name))
        # null = the field's default, for every field (a required one then reads as missing).
        return {k: v for k, v in data.items() if v is not None}


def _refusing(refused: dict[str, tuple[tuple, str]]):
    """A validator refusing, for each field of `refused`, any value but the accepted defaults."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = refused[info.field_name]
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise ValueError(f"{info.field_name} is not supported: {why}; leave it unset")
        return value

    return field_validator(*refused)(check)


_NO_BEAM = "beam search is not implemented (sample several choices with n / best_of)"
_NO_DISAGG = "no disaggregated (KV / encoder-cache transfer) serving"
_RENDER_ONLY = "it applies to vLLM's /render endpoints only, which this server does not have"
# Both endpoints: field -> (accepted values, why anything else is refused).
_REFUSED_COMMON: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False,), _NO_BEAM),
    "length_penalty": ((1.0, 1), "it only weighs beam search, which is not implemented"),
    "watermarking": ((False,), "no output watermarking"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the text"),
    "logprob_token_ids": ((), "logprobs of chosen token ids are not computed; use logprobs / top_logprobs"),
    "guided_decoding_backend": ((), "the server has one structured-output backend"),
    "guided_whitespace_pattern": ((), "the JSON grammar's whitespace rule is fixed"),
    "structural_tag": ((), "structural tags are not supported; use guided_json / response_format"),
    "priority": ((0,), "requests are scheduled first come, first served (no priorities)"),
    "cache_salt": ((), "the prefix cache is not salted per request"),
    "kv_transfer_params": ((), _NO_DISAGG),
    "ec_transfer_params": ((), _NO_DISAGG),
    "vllm_xargs": ((), "no custom extensions are loaded"),
    "logits_processors": ((), "custom logits processors are not loaded (they would run client-chosen code)"),
    "repetition_detection": ((), "not implemented; bound the output with max_tokens, stop or repetition_penalty"),
    "thinking_token_budget": ((-1,), "no reasoning parser"),
    "routed_experts_prompt_start": ((0,), "no mixture-of-experts routing data is returned"),
    "return_token_offsets": ((False,), _RENDER_ONLY),
    "return_mm_kwargs": ((True,), _RENDER_ONLY),
    "stream_interval": ((1,), "chunks go out as tokens come (merged when the client falls behind)"),
}
REFUSED_COMPLETION: dict[str, tuple[tuple, str]] = {
    **_REFUSED_COMMON,
    "prompt_embeds": ((), "prompt embeddings are not accepted; send text or token ids"),
    "suffix": (("",), "no fill-in-the-middle: the model has no suffix format"),
}
REFUSED_CHAT: dict[str, tuple[tuple, str]] = {
    **_REFUSED_COMMON,
    "continue_final_message": ((False,), "the chat template always closes the last message"),
    "add_special_tokens": ((False,), "the chat template writes the model's special tokens itself"),
    "chat_template": ((), "per-request templates are not accepted; the model's own template is used"),
    "mm_processor_kwargs": ((), "this server is text-only"),
    "media_io_kwargs": ((), "this server is text-only"),
    "include_reasoning": ((True,), "no reasoning parser: reasoning text stays in the content"),
    "return_prompt_text": ((False,), "the rendered prompt is not returned; POST /tokenize gives its ids"),
}


class StreamOptions(_Body):
    include_usage: SBool = False
    continuous_usage_stats: SBool = Field(False, description="Every chunk carries the usage so far.")


class _SamplingFields(_Body):
    """Fields shared by both generation endpoints."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    temperature: SFloat = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: SFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: SInt = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 or 0 = off.")
    min_p: SFloat = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    seed: SInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Choice i uses seed + i.")
    stop: Text | list[Text] | None = Field(None, description=f"Up to {MAX_STOP} stop strings.")
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(None, max_length=64)
    include_stop_str_in_output: SBool = False
    ignore_eos: SBool = Field(False, description="Keep generating past end-of-sequence tokens.")
    min_tokens: SInt = Field(0, ge=0, description="End-of-sequence and stop_token_ids are masked until then.")
    n: SInt = Field(1, ge=1, description="Choices per prompt.")
    best_of: SInt | None = Field(None, ge=1, description="Sample this many, return the n most likely.")
    stream: SBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: SFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: SFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: SFloat = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, SFloat] | None = Field(None, description="Token id (a string) -> bias in [-100, 100].")
    allowed_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(None, min_length=1,
                                                                                 max_length=1 << 20)
    bad_words: list[Text] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: SInt | None = Field(None, ge=-1, description="Keep only the last k prompt tokens "
                                                "(-1: max_model_len).")
    truncation_side: Literal["left", "right"] = Field("left", description="left keeps the last k, right the first k.")
    prompt_logprobs: SInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None
    return_tokens_as_token_ids: SBool = Field(False, description='Logprob tokens as "token_id:<id>".')
    return_token_ids: SBool = Field(False, description="Choices carry token_ids (and prompt_token_ids).")
    request_id: str | None = Field(None, min_length=1, max_length=128, description="The response's id suffix.")
    user: str | None = Field(None, max_length=512, description="Written to the server log with the request.")
    session_id: str | None = Field(None, max_length=512, description="Written to the server log with the request.")

    # Refused unless at their defaults (see REFUSED_*); declared so they are never "unknown".
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    watermarking: Any = False
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    logprob_token_ids: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    priority: Any = 0
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    logits_processors: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = -1
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Any = False
    return_mm_kwargs: Any = True
    stream_interval: Any = 1

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1-{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token biases are allowed")
        out = {}
        for key, bias in v.items():
            if not key.isascii() or not key.isdigit():   # the key is not echoed
                raise ValueError('keys must be token ids written as decimal strings, e.g. {"50256": -100}')
            if not -100.0 <= bias <= 100.0:
                raise ValueError("biases must be in [-100, 100]")
            out[int(key)] = bias
        return out

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str]) -> list[str]:
        if any(not w.strip() or len(w) > MAX_STOP_CHARS for w in v):
            raise ValueError(f"bad words must be 1-{MAX_STOP_CHARS} characters, not only spaces")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be >= 1 (keep that many prompt tokens) or -1 (max_model_len)")
        return v

    @model_validator(mode="after")
    def _no_stream_options_without_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    def _check_common(self, num_prompts: int) -> None:
        """Cross-field rules; InvalidRequest (a 400 naming the field) if broken."""
        if self.best_of is not None:
            if self.best_of < self.n:
                raise InvalidRequest(f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
            if self.stream and self.best_of > self.n:
                raise InvalidRequest("best_of > n cannot be streamed (the best choices are known only at the end); "
                                     "set best_of to n or stream=false", param="best_of")
        total = num_prompts * self.num_samples
        if total > MAX_SEQUENCES_PER_REQUEST:
            raise InvalidRequest(f"this request asks for {total} sequences (prompts x {'best_of' if self.best_of else 'n'}"
                                 f"); at most {MAX_SEQUENCES_PER_REQUEST} are allowed per request: split it",
                                 param="best_of" if self.best_of else "n")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs are not available with stream=true", param="prompt_logprobs")
        if self.min_tokens and self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise InvalidRequest("min_tokens must be <= max_tokens", param="min_tokens")
        self.structured_constraints()   # at most one

    @property
    def max_new_tokens(self) -> int | None:
        return None

    def structured_constraints(self) -> list[tuple[str, str, Any]]:
        """The output constraints asked for, as (param, kind, value), at most one (else InvalidRequest).
        kind/value as engine/sequence.py's StructuredSpec."""
        found: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", "json", None))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict):
                    raise InvalidRequest('response_format type "json_schema" needs "json_schema": {"name", "schema"}',
                                         param="response_format")
                schema = spec.get("schema")
                found.append(("response_format", "json", None) if schema is None
                             else ("response_format", "json_schema", _schema_text(schema, "response_format")))
            elif kind != "text":
                raise InvalidRequest('response_format type must be "text", "json_object" or "json_schema"',
                                     param="response_format")
        if self.guided_json is not None:
            found.append(("guided_json", "json_schema", _schema_text(self.guided_json, "guided_json")))
        if self.guided_regex is not None:
            found.append(("guided_regex", "regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(("guided_choice", "choice", tuple(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", "grammar", self.guided_grammar))
        if self.structured_outputs is not None:
            found += _structured_outputs(self.structured_outputs)
        if len(found) > 1:
            raise InvalidRequest("only one output constraint per request: " + ", ".join(p for p, _, _ in found),
                                 param=found[1][0])
        return found


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or a string holding one) as a JSON string."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidRequest("the JSON schema is not valid JSON", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    return json.dumps(schema)


_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json"}


def _structured_outputs(so: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """vLLM's `structured_outputs` object: json | regex | choice | grammar | json_object."""
    found = []
    for key, value in so.items():
        param = f"structured_outputs.{key}" if key.isidentifier() else "structured_outputs"
        if value is None or value is False:
            continue
        if key not in _STRUCTURED_KINDS:
            raise InvalidRequest(f"structured_outputs supports {', '.join(_STRUCTURED_KINDS)} only", param=param)
        kind = _STRUCTURED_KINDS[key]
        if kind == "json_schema":
            value = _schema_text(value, param)
        elif kind == "json":
            if value is not True:
                raise InvalidRequest("json_object must be true or false", param=param)
            value = None
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequest("choice must be a non-empty list of strings", param=param)
            value = tuple(value)
        elif not isinstance(value, str) or not value:
            raise InvalidRequest(f"{key} must be a non-empty string", param=param)
        found.append(("structured_outputs", kind, value))
    return found


class CompletionRequest(_SamplingFields):
    prompt: Text | list[SInt] | list[Text] | list[list[SInt]] = Field(
        ..., description="A string, a list of token ids, or a batch (a list of either).")
    max_tokens: SInt = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1,
                             description=f"Tokens to generate (null or absent: {DEFAULT_COMPLETION_MAX_TOKENS}); "
                                         "prompt + max_tokens <= max_model_len.")
    echo: SBool = Field(False, description="Prepend the prompt to the text (and its logprobs to logprobs).")
    logprobs: SInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Logprobs of the sampled token + top k.")
    add_special_tokens: SBool = Field(True, description="Add the model's BOS to a text prompt.")
    prompt_embeds: Any = None
    suffix: Any = ""

    refuse_non_defaults = _refusing(REFUSED_COMPLETION)

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
        return self.prompt  # normalized to a batch by _prompts

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        self._check_common(len(self.prompts))


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = Field(None, max_length=512, description="Passed to the chat template.")
    tool_call_id: str | None = Field(None, max_length=512, description='The call a "tool" message answers.')
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant message's earlier calls.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# Names the chat template sees that a request's chat_template_kwargs must not replace (or that would
# reach encode_chat as its own options, e.g. the special-token guard).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "add_generation_prompt", "allow_special_in_content", "tokenize", "bos_token", "eos_token",
    "pad_token", "tools", "raise_exception", "strftime_now"})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=1024)
    max_tokens: SInt | None = Field(None, ge=1, description="Deprecated OpenAI name of max_completion_tokens.")
    max_completion_tokens: SInt | None = Field(None, ge=1, description="Default: the rest of max_model_len.")
    logprobs: SBool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: SInt = Field(0, ge=0, le=MAX_LOGPROBS, description="With logprobs: the k most likely too.")
    echo: SBool = Field(False, description="Prepend the last message's content if it is the assistant's.")
    add_generation_prompt: SBool = Field(True, description="End the prompt with the assistant turn's opening.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template.")
    documents: list[dict[str, str]] | None = Field(None, description="The template's `documents` variable (RAG).")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="The template's `reasoning_effort` variable.")
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: SBool = True
    continue_final_message: Any = False
    add_special_tokens: Any = False
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    include_reasoning: Any = True
    return_prompt_text: Any = False

    refuse_non_defaults = _refusing(REFUSED_CHAT)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            clash = sorted(k for k in v if k in RESERVED_TEMPLATE_KWARGS)
            if clash:
                raise ValueError(f"{', '.join(clash)}: reserved names, set by the server; rename them")
            if not all(k.isidentifier() for k in v):
                raise ValueError("keys must be identifiers (template variable names)")
        return v

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
        extra = dict(self.chat_template_kwargs or {})
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
        self._check_common(1)
        found = self.structured_constraints()
        if self.tools_active and found:
            raise InvalidRequest(f"tools and {found[0][0]} both constrain the output: send one of them (or "
                                 'tool_choice "none" to only show the tools to the model)', param=found[0][0])

    @property
    def tools_active(self) -> bool:
        """Tools were given and may be called (tool_choice is not "none"): the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"


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
    tools: list[dict[str, Any]] | None = Field(None, max_length=128, description="Chat form: OpenAI function tools, "
                                               "rendered by the template as /v1/chat/completions does.")

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
        if self.tools and self.messages is None:
            raise ValueError("tools apply to the messages form only; send messages, or drop tools")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text (special tokens included, as vLLM does)."""

    model: str | None = Field(None, max_length=512, description="Model id from GET /v1/models.")
    tokens: list[SInt] = Field(..., description="Token ids, each in the model's vocabulary; at most max_model_len.")
