"""POST /v1/embeddings: OpenAI's embeddings API, served by an embedding model (--runner pooling, or detected).

Each input becomes one engine request that is prefill only (engine/pooling.py): it is tokenized off the
event loop (strings, bounded by size first) or checked (token ids), cut by truncate_prompt_tokens, and
submitted with a PoolingSpec: the checkpoint's pooling (model/embedding_config.py), its normalization unless
the request's `normalize` says otherwise, and the request's `dimensions`. The engine batches the inputs with
each other and with other requests; every input's vector is awaited (a client that leaves aborts them all),
then the answer is built off the event loop: `data` in input order, each vector as numbers or (base64) its
little-endian float32 bytes, `usage` counting the prompt tokens.

Refusals (400, naming the field): a generation model (`model`: the flag that serves embeddings), `dimensions`
on a model without Matryoshka training or outside its trained cuts (vLLM's rule), an input past the context
window without truncate_prompt_tokens, token ids outside the vocabulary, an empty input.
"""

from __future__ import annotations

import array
import base64
import json
import logging
import sys
import time
import uuid

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from graphcache.api.openai.embedding_request import EmbeddingRequest
from graphcache.api.openai.fanout import FanOut, Sub
from graphcache.api.openai.prompt_encoding import encode_prompt
from graphcache.api.openai.sampling import truncate_prompt
from graphcache.api.openai.served_model import check_model, serving_engine
from graphcache.api.openai.token_ids import vocab_size
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError, api_error_for
from graphcache.api.server.executors import run_input, run_response
from graphcache.engine.errors import InvalidRequest
from graphcache.engine.pooling import PoolingSpec
from graphcache.engine.sequence import SamplingParams, TokenIds

__all__ = ["router"]

log = logging.getLogger("graphcache.api")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)])


def _spec(engine, body: EmbeddingRequest) -> PoolingSpec:
    """The request's pooling: the checkpoint's, with its normalize and dimensions; a 400 naming the field."""
    config = getattr(engine, "embedding", None)
    if config is None:
        raise APIError(
            400,
            f"The model '{engine.model_name}' is served for text generation and does not answer /v1/embeddings; "
            "serve an embedding model (e.g. Qwen3-Embedding), or this checkpoint with --runner pooling "
            "(vLLM's --convert embed).",
            param="model",
        )
    dims = body.dimensions
    if dims is not None:
        if not config.matryoshka:
            raise APIError(
                400,
                f"The model '{engine.model_name}' does not support Matryoshka representation (its config.json "
                "has no matryoshka_dimensions or is_matryoshka); cutting its vectors would give poor results, "
                "so leave dimensions out.",
                param="dimensions",
            )
        if config.matryoshka_dimensions and dims not in config.matryoshka_dimensions:
            raise APIError(
                400,
                f"dimensions must be one of the model's Matryoshka dimensions {list(config.matryoshka_dimensions)}",
                param="dimensions",
            )
    normalize = config.normalize if body.normalize is None else body.normalize
    return PoolingSpec(config.pooling, normalize, dims)


async def _input_ids(engine, body: EmbeddingRequest, i: int, item: str | list[int]) -> list[int]:
    """Input i's ids: tokenized off the event loop, cut by truncate_prompt_tokens, bounded by the window."""
    param = "input" if len(body.inputs) == 1 else f"input[{i}]"
    if isinstance(item, str):
        ids = await encode_prompt(engine, item, body.add_special_tokens, param)
        if not ids:
            raise APIError(400, f"{param} has no tokens; send some text", param=param)
    else:
        ids = item
    limit = engine.max_model_len
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, "left", limit)
    if limit is not None and len(ids) > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens, but {param} has {len(ids)} tokens; "
            "shorten it, or set truncate_prompt_tokens to keep its last tokens.",
            param=param,
            code="context_length_exceeded",
        )
    return ids


def _checked_ids(ids: list[int], vocab: int | None, param: str) -> TokenIds:
    """The ids as a TokenIds checked against the vocabulary (the engine then trusts them)."""
    return TokenIds(ids, vocab, param)


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return values
    packed = array.array("f", values)  # float32, as OpenAI's base64 holds them
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _answer(rid: str, model: str, vectors: list[list[float]], prompt_tokens: int, encoding: str) -> Response:
    body = {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": _vector(v, encoding)}
            for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return Response(json.dumps(body, separators=(",", ":")), media_type="application/json")


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    engine = serving_engine(request)
    model = check_model(engine, body.model)
    spec = _spec(engine, body)
    vocab = vocab_size(engine)
    subs = []
    engine_rid = f"embd-{uuid.uuid4().hex}"
    rid = f"embd-{body.request_id}" if body.request_id else engine_rid
    for i, item in enumerate(body.inputs):
        ids = await _input_ids(engine, body, i, item)
        param = "input" if len(body.inputs) == 1 else f"input[{i}]"
        try:
            checked = await run_input(_checked_ids, ids, vocab, param)
        except InvalidRequest as e:
            raise api_error_for(e) from None
        subs.append(Sub(f"{engine_rid}-{i}", i, checked, SamplingParams(temperature=0.0, pooling=spec)))
    if body.user is not None:
        log.info("request %s: user=%r", rid, body.user)
    fan = FanOut(engine, subs, stream=False, max_tokens_param="input")
    outs = await fan.start_for(request.receive)  # stream=False: each one is final
    if outs is None:
        return Response(status_code=499)  # nobody reads it; keeps the access log honest
    vectors = []
    for out in outs:
        if out.embedding is None:  # an engine that ended it without a vector: a server fault, said as one
            raise APIError(
                500, "The engine returned no embedding for an input; the server log has the details."
            )
        vectors.append(out.embedding)
    prompt_tokens = sum(out.prompt_tokens for out in outs)
    return await run_response(_answer, rid, model, vectors, prompt_tokens, body.encoding_format)
