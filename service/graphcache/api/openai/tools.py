"""Endpoints tools call, with vLLM's request and response shapes.

  * POST /tokenize: `{"prompt", "add_special_tokens"?}` or `{"messages", "add_generation_prompt"?,
    "continue_final_message"?, "add_special_tokens"?, "tools"?}`, each with `"return_token_strs"?` ->
    `{"count", "max_model_len", "tokens", "token_strs"}`; the ids /v1/completions or /v1/chat/completions
    would feed the engine (same encoders, same size bound before tokenizing, off the event loop).
    `token_strs` is null unless asked: then each id's vocabulary string, as transformers'
    convert_ids_to_tokens gives it. add_special_tokens with messages (default false) adds the tokenizer's
    BOS/EOS on top of what the template wrote, as vLLM does.
  * POST /detokenize: `{"tokens"}` -> `{"prompt"}` (special tokens kept, as vLLM does); ids outside
    the tokenizer's vocabulary, or more ids than max_model_len, are a 400.
  * GET /v1/models/{model_id}: the model object of GET /v1/models, or a 404 `model_not_found`
    (OpenAI's `client.models.retrieve`); the id asked for is never echoed.
  * GET /version -> `{"version"}`; GET or POST /ping: liveness, as /health.

/tokenize, /detokenize and /v1/models/{model_id} need the API key when one is set (auth.py);
/version and /ping stay open, like the probes.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from graphcache import __version__
from graphcache.api.openai.prompt_encoding import encode_chat, encode_prompt
from graphcache.api.openai.request_constraints import template_tools
from graphcache.api.openai.served_model import check_model, model_card, model_cards, serving_engine
from graphcache.api.openai.utility_requests import DetokenizeRequest, TokenizeRequest
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError
from graphcache.api.server.executors import run_input
from graphcache.engine.errors import DEAD_MESSAGE  # liveness bodies: never the exception text

__all__ = ["guarded", "router"]

router = APIRouter(tags=["tools"])  # open, like the probes
guarded = APIRouter(tags=["tools"], dependencies=[Depends(require_api_key)])  # behind the API key


@guarded.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    engine = serving_engine(request)
    check_model(engine, body.model)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        tokens = await encode_chat(
            request,
            engine,
            body.messages,
            body.add_generation_prompt,
            body.template_kwargs,
            template_tools(body.tools),
            chat_template=body.request_template,
            continue_final_message=body.continue_final_message,
        )
        if body.add_special_tokens:  # on top of the template's own, as encode(text, True) would add them
            before, after = tokenizer.special_affixes
            tokens = [*before, *tokens, *after]
    else:
        assert body.prompt is not None  # TokenizeRequest holds exactly one of the two forms
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await encode_prompt(engine, body.prompt, add_special)
    token_strs = await run_input(tokenizer.convert_ids_to_tokens, tokens) if body.return_token_strs else None
    return {
        "count": len(tokens),
        "max_model_len": engine.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }


@guarded.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    engine = serving_engine(request)
    check_model(engine, body.model)
    limit = engine.max_model_len
    if limit is not None and len(body.tokens) > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens; send at most that many ids per request.",
            param="tokens",
            code="context_length_exceeded",
        )
    tokenizer = engine.tokenizer
    vocab = tokenizer.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:  # the index, never the value: what the caller sent is not echoed
            raise APIError(
                400,
                f"tokens[{i}] is not a token id of this model's vocabulary (0 to {vocab - 1}).",
                param=f"tokens[{i}]",
            )
    text = await run_input(tokenizer.decode, body.tokens, False)
    return {"prompt": text}


@guarded.get("/v1/models/{model_id:path}", tags=["openai"])
async def retrieve_model(model_id: str, request: Request) -> dict:
    """One model by id (the path may hold slashes, as Hugging Face names do)."""
    cards = {card["id"]: card for card in model_cards(request)}
    card = cards.get(model_id)
    if card is None:  # the caller's id is not echoed back
        raise APIError(
            404,
            f"The model does not exist; this server serves '{model_card(request)['id']}' (GET /v1/models).",
            type="invalid_request_error",
            code="model_not_found",
        )
    return card


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> JSONResponse:
    """Liveness, as GET /health (SageMaker-style probes POST it): 200 unless the engine thread died."""
    if not request.app.state.engine.alive:
        return JSONResponse({"status": "dead", "error": DEAD_MESSAGE}, status_code=503)
    return JSONResponse({"status": "ok"})
