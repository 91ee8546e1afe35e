"""Structured logs (text or JSON) with the request id in every record, plus the access log.

The request id comes from the client's X-Request-ID (if it is short and printable) or is
made up here; it is echoed in the response header and kept in a contextvar, so any log
line written while serving the request (handler, error handler) carries it. One access
line per request: client, method, path and query, status, latency.

Log injection: the path (percent-decoded, so `%0A` is a newline), the query and whatever else a
client controls reach log messages. JSON logs escape them by construction (json.dumps); the text
format escapes every control character of a message with `escape_controls`, so one record is
always one line (a traceback, appended after the message, keeps its own lines).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid

from graphcache.api.errors import error_body

__all__ = ["RequestContextMiddleware", "current_request_id", "escape_controls", "setup_logging"]

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("graphcache_request_id", default=None)
# A client-chosen id goes into logs: keep it short and free of newlines/quotes (log injection).
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")

access_log = logging.getLogger("graphcache.access")


def current_request_id() -> str | None:
    return _request_id.get()


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


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = _request_id.get()
        return True


# Attributes every LogRecord has; anything else was passed with `extra=` and belongs in the JSON.
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "request_id"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        for key, value in vars(record).items():
            if key not in _STD_ATTRS:
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{escape_controls(str(rid))}]" if rid else ""
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        # The whole message, so every field in it (path, query, method, a client's text quoted by any
        # logger, uvicorn's included) is covered, whoever wrote the log call.
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def setup_logging(log_format: str = "text", level: str = "info") -> None:
    """Configure the root logger once (idempotent): uvicorn's and our loggers all go through it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
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


class RequestContextMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would buffer streams and hide disconnects)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        rid = given if given and _SAFE_ID.match(given) else uuid.uuid4().hex
        token = _request_id.set(rid)
        start = time.perf_counter()
        status = 0

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            # Caught here, not by Starlette's outermost handler, so the log line has the request id
            # and the 500 still carries X-Request-ID. The traceback goes to the log only.
            logging.getLogger("graphcache.api").exception("unhandled error on %s %s", scope["method"], scope["path"])
            if status:
                raise  # the response already started; the server closes the connection
            status = 500
            body = json.dumps(error_body("Internal server error; the server log has the details (see "
                                         "X-Request-ID).", "server_error")).encode()
            await send({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"x-request-id", rid.encode())]})
            await send({"type": "http.response.body", "body": body})
        finally:
            client = scope.get("client") or ("-", 0)
            query = scope.get("query_string", b"").decode("latin-1")  # raw, as sent (percent-encoded)
            elapsed_ms = (time.perf_counter() - start) * 1000
            # Client-controlled: method, path, query (and the client address). The text formatter
            # escapes control characters in the message; the JSON one escapes by construction.
            access_log.info(
                '%s "%s %s%s" %s %.1fms', client[0], scope["method"], scope["path"], f"?{query}" if query else "",
                status or "-", elapsed_ms,
                extra={"method": scope["method"], "path": scope["path"], "query": query, "status": status,
                       "latency_ms": round(elapsed_ms, 2), "client": client[0]},
            )
            _request_id.reset(token)
