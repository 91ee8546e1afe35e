"""POST /invocations: SageMaker's one endpoint, routed by the body's shape as vLLM routes it.

A body with "messages" is a chat completion, one with "prompt" a completion, each validated and
answered exactly as on its own route (the same 400s naming the same fields). A body with "input" is
an embedding request: it goes to the embedding handler when the server has one (EMBEDDING_HANDLER,
set by the module that serves /v1/embeddings), else it is a 400 saying so, never a completion of
the wrong kind. Any other body is a 400 listing the shapes this endpoint takes.

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

from graphcache.api.openai import routes
from graphcache.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from graphcache.api.server.auth import require_api_key
from graphcache.api.server.errors import APIError

__all__ = ["EMBEDDING_HANDLER", "router"]

router = APIRouter(tags=["openai"], dependencies=[Depends(require_api_key)])

Handler = Callable[[Any, Request], Awaitable[Response]]
# [(its body model, its handler)] for embedding bodies; empty while no /v1/embeddings is served.
EMBEDDING_HANDLER: list[tuple[type[BaseModel], Handler]] = []

_SHAPES = '{"messages": [...]} (chat), {"prompt": ...} (completion) or {"input": ...} (embedding)'


def _route(body: dict[str, Any]) -> tuple[type[BaseModel], Handler]:
    if "messages" in body:
        return ChatCompletionRequest, routes.chat_completions
    if "prompt" in body:
        return CompletionRequest, routes.completions
    if "input" in body:
        if not EMBEDDING_HANDLER:
            raise APIError(
                400,
                "This is an embedding request, and this server serves no embedding model: send chat "
                'bodies ("messages") or completion bodies ("prompt") to /invocations.',
                param="input",
            )
        return EMBEDDING_HANDLER[0]
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
