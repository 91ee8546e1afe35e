"""The body of POST /v1/embeddings: OpenAI's fields and the vLLM extras worth having.

OpenAI: `input` (a string, a list of strings, a list of token ids, or a list of such lists; at most
MAX_EMBEDDING_INPUTS, none empty), `model`, `encoding_format` (float | base64), `dimensions` (a Matryoshka
model's cut; refused otherwise, as vLLM refuses it), `user`. vLLM: `truncate_prompt_tokens` (keep the last k
tokens of each input; -1: max_model_len), `normalize` (default: as the checkpoint says), `add_special_tokens`,
`request_id`. The body's rules are api/openai/body.py's (strict numbers, null = default, unknown fields logged).
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import Field, field_validator

from graphcache.api.openai.body import RequestBody, SBool, SInt, Text

__all__ = ["MAX_EMBEDDING_INPUTS", "EmbeddingRequest"]

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one request's inputs


class EmbeddingRequest(RequestBody):
    model: str | None = Field(None, description="The served model's id (GET /v1/models); absent: that model.")
    input: Text | list[SInt] | list[Text] | list[list[SInt]] = Field(
        ..., description="A string, a list of token ids, or a batch (a list of either)."
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes."
    )
    dimensions: SInt | None = Field(
        None, description="Keep the first n values (Matryoshka models only), normalized after the cut."
    )
    user: str | None = Field(None, max_length=512, description="Written to the server log with the request.")
    truncate_prompt_tokens: SInt | None = Field(
        None,
        description="Keep each input's last k tokens (-1: max_model_len) instead of refusing a long one.",
    )
    normalize: SBool | None = Field(
        None, description="L2-normalize the vectors; default: as the checkpoint says."
    )
    add_special_tokens: SBool = Field(True, description="Add the model's special tokens to a text input.")
    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="The response's id suffix."
    )

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        """Always a list of inputs, each a string or a list of ids, none empty, at most MAX_EMBEDDING_INPUTS."""
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if not v or any(len(p) == 0 for p in batch):
            raise ValueError("input must not be empty (nor any input of a batch)")
        if len(batch) > MAX_EMBEDDING_INPUTS:
            raise ValueError(
                f"input holds {len(batch)} inputs; send at most {MAX_EMBEDDING_INPUTS} a request"
            )
        return batch

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, v):
        if v is not None and v < 1:
            raise ValueError("dimensions must be at least 1")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1")
        return v

    @property
    def inputs(self) -> list[str | list[int]]:
        return cast("list[str | list[int]]", self.input)  # normalized to a batch by _inputs
