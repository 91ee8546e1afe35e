"""POST /invocations: SageMaker's one endpoint, routed by the body's shape as vLLM routes it.

A body with "messages" is a chat completion, one with "prompt" a completion, each validated and
answered exactly as on its own route (the same 400s naming the same fields). A body with "input" is
an embedding request, answered as /v1/embeddings answers it (a generation model: the 400 naming the
flag that serves embeddings), never a completion of the wrong kind. Any other body is a 400 listing
the shapes this endpoint takes.

vLLM tries each request type's validation in turn; here the shape decides first, so a chat body with
a bad field gets the chat route's 400 for that field instead of "no suitable handler". The endpoint
is behind the API key like /v1/* (it generates).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from graphcache.api.openai import embeddings, routes
from graphcache.api.openai.embedding_request import EmbeddingRequest
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError

__all__ = ["router"]

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])

Handler = Callable[[Any, Request], Awaitable[Response]]

_SHAPES = '{"messages": [...]} (chat), {"prompt": ...} (completion) or {"input": ...} (embedding)'


def _route(body: dict[str, Any]) -> tuple[type[BaseModel], Handler]:
    if "messages" in body:
        return ChatCompletionRequest, routes.chat_completions
    if "prompt" in body:
        return CompletionRequest, routes.completions
    if "input" in body:
        return EmbeddingRequest, embeddings.embeddings
    raise APIError(400, f"Cannot tell what kind of request this is: /invocations takes {_SHAPES}.")


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise APIError(400, "The body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise APIError(400, f"The body must be a JSON object: {_SHAPES}.")
    model, handler = _route(body)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:  # the same 400 the route itself gives (its errors sit under "body")
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        ) from None
    return await handler(parsed, request)
