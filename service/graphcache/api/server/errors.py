"""OpenAI-style error bodies for every failure the HTTP floor can answer.

Every non-2xx response is `{"error": {"message", "type", "param", "code"}}`, the shape the
official clients parse. Validation errors become 400 (never FastAPI's 422 list), unknown
routes 404, wrong methods 405, and anything unexpected a bare 500: messages never carry
stack traces, input values or file paths, only what the caller can fix.

The engine's refusals are typed exceptions (engine/errors.py); `api_error_for` is the one map
from them to HTTP errors, and `count_rejection` the one place refused generation requests are
counted (the error handlers and the body-size middleware call it; nothing else does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphcache.engine.errors import (
    CLIENT_ERROR_CODES,
    EngineDead,
    EngineDraining,
    EngineNotReady,
    InvalidRequest,
    QueueFull,
)
from graphcache.metrics import Metrics

__all__ = [
    "APIError",
    "api_error_for",
    "clip",
    "count_rejection",
    "error_body",
    "error_response",
    "install_error_handlers",
]

RETRY_AFTER_S = "1"
# Caller input quoted in a message is cut to this many characters: enough to find the value in the
# body, never a way to make the server send back (or log) what a client sent in bulk.
ECHO_CHARS = 64
# A message never exceeds this, whatever a check put in it (a backstop behind `clip`).
MAX_MESSAGE_CHARS = 1024


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as a message may quote it: repr() for non-strings, cut to `limit` characters with an
    ellipsis and the full length when longer, lone surrogates escaped (the body is UTF-8 JSON)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# The `type` field OpenAI uses for each status class.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers to answer with an OpenAI-style error; `message` must name the fix."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers


def api_error_for(exc: Exception, *, in_flight: bool = False) -> APIError:
    """The HTTP error for one of the engine's refusals (engine/errors.py).

    in_flight: the request was already running and the engine ended it with an error while in the
    state `exc` describes; for a draining (or stopped) engine that is the drain timeout cutting it
    (Engine.drain): a 503 `shutting_down` to retry elsewhere, not a 500 and not a `draining` refusal.
    """
    if in_flight and isinstance(exc, EngineDraining):
        return APIError(
            503,
            "The server is shutting down and the request did not finish within its drain "
            "timeout; retry it on another replica.",
            code="shutting_down",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, InvalidRequest):  # the engine's own validation: the message names the fix
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFull):
        return APIError(
            429,
            "The server's waiting queue is full; retry after the Retry-After seconds.",
            code="queue_full",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, EngineDraining):
        return APIError(
            503,
            "The server is shutting down and takes no new requests; retry on another replica.",
            code="draining",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, EngineNotReady):
        return APIError(
            503,
            "The model is still loading; retry when GET /ready answers 200.",
            code="not_ready",
            headers={"Retry-After": RETRY_AFTER_S},
        )
    if isinstance(exc, EngineDead):
        return APIError(
            503, "The engine is dead; restart the server (the server log has the error).", code="engine_dead"
        )
    raise TypeError(f"not an engine refusal: {type(exc).__name__}") from exc


def api_error_for_ended(
    message: str | None, error_code: str | None, constraint_param: str | None
) -> APIError | None:
    """The 400 for a request the engine ended with an error the request itself caused (its output
    constraint too costly or too complex: engine/errors.py CLIENT_ERROR_CODES), naming the field that
    set the constraint; None for a server-side failure (the caller's 500)."""
    if error_code not in CLIENT_ERROR_CODES:
        return None
    return APIError(
        400,
        message or "The request's output constraint is too complex; simplify it.",
        param=constraint_param,
        code=error_code,
    )


# requests_rejected reason of a refused generation request, by (status, code); others are not counted.
_REJECTION_REASONS = {429: "queue_full", 400: "invalid", 413: "invalid"}


def count_rejection(
    metrics: Metrics | None, request_path: str, method: str, status: int, code: str | None = None
) -> None:
    """Count a refused generation request (POST /v1/...) in requests_rejected, by a bounded reason."""
    if metrics is None or method != "POST" or not request_path.startswith("/v1/"):
        return
    reason = "draining" if status == 503 and code == "draining" else _REJECTION_REASONS.get(status)
    if reason is not None:
        metrics.requests_rejected.labels(reason).inc()


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    err = APIError(status, message, param=param, code=code, type=type, headers=headers)
    return JSONResponse(
        error_body(err.message, err.type, err.param, err.code), status_code=status, headers=headers
    )


# pydantic puts the branch of a union (and the validators wrapping a type) into an error's loc:
# ("prompt", "function-after[_encodable(), str]"), ("prompt", "list[int]", 0), ("content", "list[TextPart]", 0,
# "type"), "tagged-union[...]", "nullable[...]", "int". Field names (snake_case identifiers) and list
# indices are what a caller can find in the body; everything else is such a tag.
_WHERE = ("body", "query", "path", "header")
_TYPE_TAGS = frozenset(
    {
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "none",
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "any",
        "decimal",
        "date",
        "datetime",
        "time",
        "timedelta",
        "uuid",
        "url",
    }
)


def _is_tag(part: object) -> bool:
    if isinstance(part, int):
        return False
    text = str(part)
    return not text.isidentifier() or text in _TYPE_TAGS or text[:1].isupper()


def _clean_loc(loc: tuple) -> tuple:
    return tuple(p for p in loc if p not in _WHERE and not _is_tag(p))


def _param_of(loc: tuple) -> str | None:
    """("body", "messages", 0, "content", "function-after[_encodable(), str]") -> "messages[0].content"
    (field names and list indices only, never pydantic's union tags); the body itself -> None."""
    out = ""
    for p in _clean_loc(loc):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _most_specific(errors: Sequence[Any]) -> dict:
    """The first error, or, when it is one branch of a union, the deepest error among that field's
    branches: `prompt: [1.5]` fails as a string at `prompt` and as token ids at `prompt[0]`; the
    latter says what to fix."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if not any(_is_tag(p) for p in loc if p not in _WHERE):
        return first
    field = _clean_loc(loc)
    branches = [e for e in errors if _clean_loc(tuple(e.get("loc", ())))[: len(field)] == field]
    return max(branches, key=lambda e: len(_clean_loc(tuple(e.get("loc", ())))))  # the first of the deepest


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = _most_specific(errors)
    param = _param_of(tuple(first.get("loc", ())))
    named = getattr((first.get("ctx") or {}).get("error"), "param", None)  # body.FieldError's field
    if param is None and isinstance(named, str):
        return str(first.get("msg", "invalid value")).removeprefix("Value error, "), named
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    if first.get("type") == "missing" and param is None:
        return "The request needs a JSON body.", None
    # pydantic's `msg` names the rule ("Input should be less than or equal to 2"); `input` is left out
    # on purpose so hostile or huge values are never echoed back.
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI, metrics: Metrics | None = None) -> None:
    """OpenAI-shaped bodies for every error; refused generation requests counted in `metrics`."""

    def _note(request: Request, status: int, code: str | None = None) -> None:
        count_rejection(metrics, request.url.path, request.method, status, code)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _note(request, exc.status, exc.code)
        return error_response(
            exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        _note(request, 400)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Neither the path nor the method is echoed: both are the caller's input.
        if exc.status_code == 404:
            message = "No such route; see /docs for the API."
        elif exc.status_code == 405:
            message = (
                "This method is not allowed on this route (the Allow header lists those that are); see /docs."
            )
        else:
            # FastAPI's own HTTPExceptions (e.g. "There was an error parsing the body") carry safe text.
            message = str(exc.detail) if isinstance(exc.detail, str) else "Invalid request."
        _note(request, exc.status_code)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    # Unexpected exceptions are answered by RequestContextMiddleware (request_log.py), which knows the request id.
