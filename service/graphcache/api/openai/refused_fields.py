"""The vLLM request fields graphcache declares but cannot honour, each with the reason its 400 gives.

protocol.py's models declare these fields (so they are never "unknown") and attach `refusing(...)`:
a value other than the accepted defaults is a 400 "<field> is not supported: <why>; leave it unset".
Accepted values match by value and type (False is not 0, 1.0 and 1 are listed separately).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo, field_validator

__all__ = ["REFUSED_CHAT", "REFUSED_COMPLETION", "refusing"]


def refusing(refused: dict[str, tuple[tuple, str]]):
    """A validator refusing, for each field of `refused`, any value but the accepted defaults."""

    def check(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        assert name is not None  # a field validator's info names its field
        accepted, why = refused[name]
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise ValueError(f"{name} is not supported: {why}; leave it unset")
        return value

    return field_validator(*refused)(check)


_NO_DISAGG = "no disaggregated (KV / encoder-cache transfer) serving"
_RENDER_ONLY = "it applies to vLLM's /render endpoints only, which this server does not have"
# Both endpoints: field -> (accepted values, why anything else is refused).
_REFUSED_COMMON: dict[str, tuple[tuple, str]] = {
    "watermarking": ((False,), "no output watermarking"),
    "spaces_between_special_tokens": (
        (True,),
        "special tokens are left out of the text, or (skip_special_tokens false) joined as the tokenizer decodes them",
    ),
    "logprob_token_ids": ((), "logprobs of chosen token ids are not computed; use logprobs / top_logprobs"),
    "guided_decoding_backend": ((), "the server has one structured-output backend"),
    "guided_whitespace_pattern": ((), "the JSON grammar's whitespace rule is fixed"),
    "structural_tag": ((), "structural tags are not supported; use guided_json / response_format"),
    "cache_salt": ((), "the prefix cache is not salted per request"),
    "kv_transfer_params": ((), _NO_DISAGG),
    "ec_transfer_params": ((), _NO_DISAGG),
    "vllm_xargs": ((), "no custom extensions are loaded"),
    "logits_processors": ((), "custom logits processors are not loaded (they would run client-chosen code)"),
    "repetition_detection": (
        (),
        "not implemented; bound the output with max_tokens, stop or repetition_penalty",
    ),
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
    "add_special_tokens": ((False,), "the chat template writes the model's special tokens itself"),
    "mm_processor_kwargs": ((), "this server is text-only"),
    "media_io_kwargs": ((), "this server is text-only"),
    "include_reasoning": ((True,), "no reasoning parser: reasoning text stays in the content"),
    "return_prompt_text": ((False,), "the rendered prompt is not returned; POST /tokenize gives its ids"),
}
