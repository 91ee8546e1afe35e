"""Structured logs (text or JSON) with the request id in every record, plus the access log.

Libraries do the generic parts: asgi-correlation-id reads the client's X-Request-ID (kept only if it
is short and printable, else a new uuid4 hex), keeps it in a contextvar for the request and echoes it
in the response header; its log filter puts it on every record as `correlation_id`.
python-json-logger writes the JSON records. What they do not do stays here: the access line (one
per request: client, method, path and query, status, latency), the 500 for an unhandled exception
(so the log line and the response both carry the id), and the text format's escaping.

Log injection: the path (percent-decoded, so `%0A` is a newline), the query and whatever else a
client controls reach log messages. JSON logs escape them by construction (json.dumps, ASCII only);
the text format escapes every control character of a message with `escape_controls`, so one record
is always one line (a traceback, appended after the message, keeps its own lines).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable

from asgi_correlation_id import CorrelationIdFilter, CorrelationIdMiddleware, correlation_id
from pythonjsonlogger.json import JsonFormatter as _LibraryJsonFormatter

from graphcache.api.server.errors import clip, error_body

__all__ = [
    "PROBE_PATHS",
    "RequestContextMiddleware",
    "current_request_id",
    "escape_controls",
    "log_unhandled",
    "setup_logging",
]

# A client-chosen id goes into logs: keep it short and free of newlines/quotes (log injection).
_SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

access_log = logging.getLogger("graphcache.access")

# Probes and scrapes: polled every few seconds by orchestrators and Prometheus, so their access lines
# go out at DEBUG; at INFO they would bury the traffic.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/ping", "/version"})
# A 4xx's reason comes from its error body (ours, small); never more than this is kept or logged.
MAX_ERROR_BODY_BYTES = 8192
MAX_REASON_CHARS = 300


def current_request_id() -> str | None:
    return correlation_id.get()


def is_safe_request_id(value: str) -> bool:
    """The client's X-Request-ID is kept only if this holds; else asgi-correlation-id makes a new one."""
    return _SAFE_ID.fullmatch(value) is not None


# C0 controls (CR, LF, TAB, ESC, ...), DEL, C1 controls (NEL \x85, CSI \x9b, ...) and the Unicode line and
# paragraph separators: anything a terminal or a line-splitting log reader could take as a line break
# or an escape sequence.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escape_controls(text: str) -> str:
    """`text` with every control character written as an escape (`\\n`, `\\r`, `\\t`, `\\x1b`, `\\u2028`):
    what a client sent can never start a new log line or drive the terminal that shows the log."""
    return _CONTROLS.sub(_escaped, text)


class JsonFormatter(_LibraryJsonFormatter):
    """One JSON object a line: ts (UTC, ms), level, logger, msg, request_id (inside a request), every
    `extra=` field, exc (a traceback). ensure_ascii (the default) escapes \\x85 and \\u2028 as well."""

    # Annotated: bare, mypy would take the function for a method and bind it to self (a builtin is not).
    converter: Callable[[float | None], time.struct_time] = time.gmtime
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def __init__(self) -> None:
        super().__init__(
            "{asctime}{levelname}{name}{message}{correlation_id}",
            style="{",
            rename_fields={
                "asctime": "ts",
                "levelname": "level",
                "name": "logger",
                "message": "msg",
                "correlation_id": "request_id",
                "exc_info": "exc",
            },
        )

    def process_log_record(self, log_data: dict) -> dict:
        log_data["level"] = log_data["level"].lower()
        log_data.pop("color_message", None)  # uvicorn's copy of msg with ANSI colours: noise in JSON
        if log_data.get("request_id") is None:
            log_data.pop("request_id", None)  # outside a request: no key rather than null
        return log_data


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(_rid)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        # The whole message, so every field in it (path, query, method, a client's text quoted by any
        # logger, uvicorn's included) is covered, whoever wrote the log call.
        rid = getattr(record, "correlation_id", None)
        record._rid = f" [{escape_controls(str(rid))}]" if rid else ""
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def setup_logging(log_format: str = "text", level: str = "info") -> None:
    """Configure the root logger once (idempotent): uvicorn's and our loggers all go through it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(CorrelationIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_graphcache", False):
            root.removeHandler(old)
    handler._graphcache = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's loggers propagate to root; its own access log is replaced by ours (with ids + latency).
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True


# Fault sites whose traceback was logged already; bounded so that varied faults cannot grow it forever.
MAX_FAULT_SITES = 256
_logged_sites: set[tuple[str, str, int]] = set()


def _fault_site(exc: BaseException) -> tuple[str, str, int]:
    """(exception type, file, line) of where `exc` was raised: the innermost frame of its traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code if tb is not None else None
    return type(exc).__name__, code.co_filename if code else "?", tb.tb_lineno if tb is not None else 0


def log_unhandled(method: str, path: str) -> None:
    """The log of a 500 (call inside `except`): one line per request, with its request id (every
    record carries it), and the traceback only the first time a fault site is seen. A fault that
    many clients trigger then costs one line each, not a traceback each, and the first shows where."""
    exc = sys.exc_info()[1]
    site = _fault_site(exc) if exc is not None else ("?", "?", 0)
    first = site not in _logged_sites and len(_logged_sites) < MAX_FAULT_SITES
    log = logging.getLogger("graphcache.api")
    if first:
        _logged_sites.add(site)
        log.exception(
            "unhandled error on %s %s (its traceback follows, logged once per fault site)", method, path
        )
    else:
        log.error(
            "unhandled error on %s %s: %s: %s (at %s:%d; traceback logged at its first occurrence)",
            method,
            path,
            site[0],
            clip(str(exc), 200),
            site[1].rsplit("/", 1)[-1],
            site[2],
        )


def refusal_reason(response_body: bytes) -> dict:
    """A 4xx's reason, param and code, read from the error body this server sent (never the request's
    body); the reason clipped. Not our error shape (or cut short): reason "-"."""
    try:
        error = json.loads(response_body)["error"]
        return {
            "reason": clip(error.get("message") or "-", MAX_REASON_CHARS),
            "param": error.get("param"),
            "code": error.get("code"),
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"reason": "-", "param": None, "code": None}


def _refusal_suffix(refusal: dict) -> str:
    param, code = refusal["param"], refusal["code"]
    return (
        f" refused: {refusal['reason']}"
        + (f" (param {clip(param, 80)})" if param else "")
        + (f" [code {clip(code, 80)}]" if code else "")
    )


class AccessLogMiddleware:
    """The access line and the 500 for an unhandled exception. Pure ASGI (BaseHTTPMiddleware would
    buffer streams and hide disconnects). Runs inside the correlation-id middleware, so the id is set
    for its log lines and the 500 it sends gets X-Request-ID added on the way out."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        error_body_seen = bytearray()  # a 4xx's body, to log its reason (bounded)

        async def send_noting_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                room = MAX_ERROR_BODY_BYTES - len(error_body_seen)
                if room > 0:
                    error_body_seen.extend(message.get("body", b"")[:room])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except Exception:
            # Caught here, not by Starlette's outermost handler, so the log line has the request id
            # and the 500 still carries X-Request-ID. The traceback goes to the log only.
            log_unhandled(scope["method"], scope["path"])
            if status:
                raise  # the response already started; the server closes the connection
            status = 500
            body = json.dumps(
                error_body(
                    "Internal server error; the server log has the details (see X-Request-ID).",
                    "server_error",
                )
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
        finally:
            client = scope.get("client") or ("-", 0)
            query = scope.get("query_string", b"").decode("latin-1")  # raw, as sent (percent-encoded)
            elapsed_ms = (time.perf_counter() - start) * 1000
            # A 4xx's line says why (one line a request, so the reason sits with its request id);
            # a probe's or scrape's line goes out at DEBUG unless it was refused.
            refusal = refusal_reason(bytes(error_body_seen)) if 400 <= status < 500 else None
            quiet = scope["path"] in PROBE_PATHS and refusal is None
            # Client-controlled: method, path, query (and the client address). The text formatter
            # escapes control characters in the message; the JSON one escapes by construction.
            access_log.log(
                logging.DEBUG if quiet else logging.INFO,
                '%s "%s %s%s" %s %.1fms%s',
                client[0],
                scope["method"],
                scope["path"],
                f"?{query}" if query else "",
                status or "-",
                elapsed_ms,
                _refusal_suffix(refusal) if refusal else "",
                extra={
                    "method": scope["method"],
                    "path": scope["path"],
                    "query": query,
                    "status": status,
                    "latency_ms": round(elapsed_ms, 2),
                    "client": client[0],
                    **(refusal or {}),
                },
            )


class RequestContextMiddleware(CorrelationIdMiddleware):
    """asgi-correlation-id's middleware (X-Request-ID in, contextvar, header out) around the access log.
    One class, so the app registers both with one `add_middleware(RequestContextMiddleware)`."""

    def __init__(self, app) -> None:
        super().__init__(
            app=AccessLogMiddleware(app), header_name="X-Request-ID", validator=is_safe_request_id
        )
