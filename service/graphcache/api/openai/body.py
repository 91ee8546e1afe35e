"""The base of every request body: strict scalars, `null` as the default, unknown fields logged.

Numbers are strict (no "5" for 5, no true for 1): a wrong JSON type is a 400, not a silent conversion.
`null` means "the field's default" for every field (a required one then reads as missing). A field
unknown to the model is accepted and logged once per name, as vLLM does (a newer client's field must
not break an older server); protocol.py's models declare every field of OpenAI's and vLLM's requests,
so "unknown" means unknown to both.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Strict, model_validator

__all__ = ["MAX_UNKNOWN_NAMES_LOGGED", "RequestBody", "SBool", "SFloat", "SInt", "Text"]

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


class FieldError(ValueError):
    """A cross-field rule's failure in a model validator, naming the field to fix: pydantic gives a
    model validator's error no location, so the 400's `param` comes from here (api/server/errors.py)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


MAX_UNKNOWN_NAMES_LOGGED = 256  # a client sending random names must not grow the set forever

_unknown_logged: set[str] = set()
# OpenAI's non-text content parts, by the field that carries each: OpenAI's, but not served here.
OPENAI_UNSUPPORTED_PARTS = {
    "image_url": "image input",
    "input_audio": "audio input",
    "file": "file input",
}


def _log_unknown(model: str, name: str) -> None:
    if name in _unknown_logged or len(_unknown_logged) >= MAX_UNKNOWN_NAMES_LOGGED:
        return
    _unknown_logged.add(name)
    if name in OPENAI_UNSUPPORTED_PARTS:
        log.warning(
            "field %r of %s is an OpenAI content part (%s) this server does not support: it serves "
            "text only (logged once per name)",
            name,
            model,
            OPENAI_UNSUPPORTED_PARTS[name],
        )
        return
    log.warning(
        "field %r of %s is neither OpenAI's nor vLLM's; it is accepted and has no effect "
        "(logged once per name)",
        name[:64],
        model,
    )


class RequestBody(BaseModel):
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
