"""The fields both generation endpoints share (sampling controls, streaming, limits), as a pydantic base.

CompletionRequest and ChatCompletionRequest (protocol.py) add their prompt form, max_tokens naming
and logprobs shape. Honoured fields are mapped into SamplingParams by api/openai/sampling.py; the vLLM fields
graphcache cannot honour are declared here too (so they are never "unknown") and refused unless at
their defaults (api/openai/refused_fields.py); the structured-output fields are parsed by api/openai/constraints.py.
Checks across fields that need a `param` (best_of >= n, the sequence limit, one structured-output
constraint) raise InvalidRequest from `_check_common`; single-field checks are pydantic validators (a 400).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, field_validator, model_validator

from graphcache.api.openai import constraints
from graphcache.api.openai.body import FieldError, RequestBody, SBool, SFloat, SInt, Text
from graphcache.engine.errors import InvalidRequest

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOGPROBS",
    "MAX_SEQUENCES_PER_REQUEST",
    "MAX_STOP",
    "SamplingFields",
    "StreamOptions",
]

MAX_STOP = 64
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # logprobs / top_logprobs / prompt_logprobs, as OpenAI
MAX_SEQUENCES_PER_REQUEST = 128  # prompts x max(n, best_of): each is one engine request
MAX_BAD_WORDS = 128
MAX_LOGIT_BIAS = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SEED = INT64_MAX


MAX_KEYS_NAMED = 5
MAX_KEY_CHARS = 32


def _keys(keys: list[str]) -> str:
    """logit_bias keys as an error names them (after "logit_bias: "): JSON-quoted, each cut to MAX_KEY_CHARS, at
    most MAX_KEYS_NAMED of them."""
    shown = [
        json.dumps(k if len(k) <= MAX_KEY_CHARS else k[:MAX_KEY_CHARS] + "...") for k in keys[:MAX_KEYS_NAMED]
    ]
    more = f" and {len(keys) - MAX_KEYS_NAMED} more" if len(keys) > MAX_KEYS_NAMED else ""
    return f"key{'s' if len(keys) > 1 else ''} {', '.join(shown)}{more}"


class StreamOptions(RequestBody):
    include_usage: SBool = False
    continuous_usage_stats: SBool = Field(
        False, description="With include_usage: every chunk carries the usage so far."
    )


class SamplingFields(RequestBody):
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
    skip_special_tokens: SBool = Field(True, description="False: keep special tokens' text in the output.")
    ignore_eos: SBool = Field(False, description="Keep generating past end-of-sequence tokens.")
    min_tokens: SInt = Field(0, ge=0, description="End-of-sequence and stop_token_ids are masked until then.")
    n: SInt = Field(1, ge=1, description="Choices per prompt.")
    best_of: SInt | None = Field(None, ge=1, description="Sample this many, return the n most likely.")
    stream: SBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: SFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: SFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: SFloat = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, SFloat] | None = Field(
        None, description="Token id (a string) -> bias in [-100, 100]."
    )
    allowed_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=1 << 20
    )
    bad_words: list[Text] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: SInt | None = Field(
        None, ge=-1, description="Keep only the last k prompt tokens (-1: max_model_len)."
    )
    truncation_side: Literal["left", "right"] = Field(
        "left", description="left keeps the last k, right the first k."
    )
    prompt_logprobs: SInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    guided_json: Text | dict[str, Any] | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    structured_outputs: dict[str, Any] | None = None
    return_tokens_as_token_ids: SBool = Field(False, description='Logprob tokens as "token_id:<id>".')
    return_token_ids: SBool = Field(False, description="Choices carry token_ids (and prompt_token_ids).")
    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="The response's id suffix."
    )
    user: str | None = Field(None, max_length=512, description="Written to the server log with the request.")
    session_id: str | None = Field(
        None, max_length=512, description="Written to the server log with the request."
    )
    priority: SInt = Field(
        0,
        ge=INT64_MIN,
        le=INT64_MAX,
        description="With --scheduling-policy priority: lower runs first (ties by arrival); else only 0.",
    )

    use_beam_search: SBool = Field(
        False, description="Beam search (api/openai/beam_search.py): n beams, ranked, answered whole."
    )
    length_penalty: SFloat = Field(
        1.0, description="Beam search: score = cumulative logprob / length ** this."
    )

    # Refused unless at their defaults (api/openai/refused_fields.py); declared so they are never "unknown".
    watermarking: Any = False
    spaces_between_special_tokens: Any = True
    logprob_token_ids: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
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
        bad = [key for key in v if not key.isascii() or not key.isdigit()]
        if bad:  # every offending key is named (bounded: a key may be any length)
            raise ValueError(
                f"{_keys(bad)} {'is not a token id' if len(bad) == 1 else 'are not token ids'}; keys are "
                'token ids written as decimal strings, e.g. {"50256": -100}'
            )
        out = {}
        for key, bias in v.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of {_keys([key])} is {bias:g}; biases are in [-100, 100]")
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
            raise FieldError("stream_options is only allowed with stream=true", param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: continuous_usage_stats counts only together with include_usage (as vLLM)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

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
                raise InvalidRequest(
                    "best_of > n cannot be streamed (the best choices are known only at the end); "
                    "set best_of to n or stream=false",
                    param="best_of",
                )
        total = num_prompts * self.num_samples
        if total > MAX_SEQUENCES_PER_REQUEST:
            raise InvalidRequest(
                f"this request asks for {total} sequences (prompts x {'best_of' if self.best_of else 'n'}"
                f"); at most {MAX_SEQUENCES_PER_REQUEST} are allowed per request: split it",
                param="best_of" if self.best_of else "n",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest(
                "prompt_logprobs are not available with stream=true", param="prompt_logprobs"
            )
        if self.min_tokens and self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise InvalidRequest("min_tokens must be <= max_tokens", param="min_tokens")
        self.structured_constraints()  # at most one

    @property
    def max_new_tokens(self) -> int | None:
        return None

    def structured_constraints(self) -> list[tuple[str, str, Any]]:
        """The output constraints asked for, as (param, kind, value), at most one (else InvalidRequest).
        kind/value as engine/sequence.py's StructuredSpec."""
        return constraints.structured_constraints(
            response_format=self.response_format,
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
            structured_outputs=self.structured_outputs,
        )
