"""Logs and log injection: whatever a client controls (the percent-decoded path, the query, the
method) can never forge a log line. The text format escapes control characters in every message;
the JSON format stays one valid JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

import httpx
import pytest
from asgi_correlation_id import correlation_id
from graphcache.api.server.app import create_app
from graphcache.api.server.request_log import (
    RequestContextMiddleware,
    escape_controls,
    is_safe_request_id,
    setup_logging,
)
from graphcache.config import Settings
from graphcache.metrics import Metrics
from helpers_api import EngineNotNeeded

# A request line that, unescaped, writes a second, forged access-log line.
FORGED = '2030-01-01 00:00:00,000 INFO graphcache.access [deadbeef]: 10.0.0.1 "GET /admin/clear" 200 0.1ms'
INJECT_PATH = "/v1/whatever%0A" + FORGED.replace(" ", "%20").replace('"', "%22")
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+")


@pytest.fixture
def captured_logs(monkeypatch):
    """setup_logging(format) writing into a buffer; the handler and levels are put back afterwards."""
    root = logging.getLogger()
    level = root.level
    buffer = io.StringIO()

    def setup(log_format: str) -> io.StringIO:
        # Here, not at fixture setup: pytest's capture swaps sys.stderr again when the test starts.
        monkeypatch.setattr(sys, "stderr", buffer)  # setup_logging's StreamHandler binds sys.stderr
        setup_logging(log_format, "info")
        return buffer

    try:
        yield setup
    finally:
        for handler in list(root.handlers):
            if getattr(handler, "_graphcache", False):
                root.removeHandler(handler)
        root.setLevel(level)


def access_lines(text: str) -> list[str]:
    # splitlines() also splits on \x85, \u2028 and friends: the strictest reader's idea of a line.
    # "DATE TIME LEVEL LOGGER[ [id]]: message": the logger is the fourth field.
    return [
        line
        for line in text.splitlines()
        if line.split(" ")[3:4] in (["graphcache.access"], ["graphcache.access:"])
    ]


def test_json_logs_carry_the_request_id_and_extra_fields(captured_logs):
    """Moved from test_cli.py: the JSON keys log pipelines rely on (python-json-logger writes them)."""
    logs = captured_logs("json")
    token = correlation_id.set("rid-42")
    try:
        logging.getLogger("graphcache.test").info("hello %s", "world", extra={"status": 200})
    finally:
        correlation_id.reset(token)
    logging.getLogger("graphcache.test").info("outside a request")
    inside, outside = (json.loads(line) for line in logs.getvalue().splitlines())
    assert inside["msg"] == "hello world" and inside["request_id"] == "rid-42" and inside["status"] == 200
    assert inside["level"] == "info" and inside["logger"] == "graphcache.test"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", inside["ts"]), inside["ts"]
    assert "request_id" not in outside


def test_only_short_printable_request_ids_are_kept():
    assert is_safe_request_id("trace-42.a_b:c") and is_safe_request_id("a" * 128)
    for hostile in ("", "a" * 129, "bad id", "x\n", "abc\n", 'q"uote', "é"):
        assert not is_safe_request_id(hostile), hostile


def test_escape_controls_writes_every_control_character_as_an_escape():
    assert escape_controls("a\nb\r\nc\td") == "a\\nb\\r\\nc\\td"
    assert escape_controls("\x1b[31mred\x00\x7f") == "\\x1b[31mred\\x00\\x7f"
    assert escape_controls("nel\x85csi\x9b ls\u2028ps\u2029") == "nel\\x85csi\\x9b ls\\u2028ps\\u2029"
    plain = 'GET /v1/completions?x=1 "quoted" é ✓ 中文'
    assert escape_controls(plain) == plain
    assert len(escape_controls("".join(map(chr, range(0x20)))).splitlines()) == 1


async def _get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get(path)


async def test_text_log_a_newline_in_the_path_writes_exactly_one_access_line(captured_logs):
    logs = captured_logs("text")
    app = create_app(Settings(), engine=EngineNotNeeded(), metrics=Metrics())
    response = await _get(app, INJECT_PATH + "?q=%0D%0A")
    assert response.status_code == 404
    text = logs.getvalue()
    lines = access_lines(text)
    assert len(lines) == 1, text
    assert "/v1/whatever\\n2030-01-01" in lines[0], lines[0]  # the newline, escaped, on the same line
    assert response.headers["x-request-id"] in lines[0]
    assert all(TEXT_LINE.match(line) for line in text.splitlines()), text  # no line starts with forged text
    assert not any(line.startswith(FORGED[:20]) for line in text.splitlines())


async def test_json_log_stays_one_valid_object_per_line(captured_logs):
    logs = captured_logs("json")
    app = create_app(Settings(), engine=EngineNotNeeded(), metrics=Metrics())
    response = await _get(app, INJECT_PATH + "?q=%0D%0A")
    assert response.status_code == 404
    records = [json.loads(line) for line in logs.getvalue().splitlines()]  # each line is JSON on its own
    access = [r for r in records if r["logger"] == "graphcache.access"]
    assert len(access) == 1, records
    assert access[0]["path"] == "/v1/whatever\n" + FORGED  # the value itself, escaped by json.dumps
    assert access[0]["query"] == "q=%0D%0A" and access[0]["status"] == 404


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_control_characters_in_query_method_and_path_never_break_a_line(captured_logs, log_format):
    """Raw control bytes in the query (HTTP parsers refuse them, an ASGI server in front may not), C1
    controls and ANSI escapes: still one line per record, in both formats."""
    logs = captured_logs(log_format)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET\r\nX",
        "scheme": "http",
        "path": "/p\x85\u2028\x1b[2J\rforged",
        "raw_path": b"/p",
        "query_string": b"a=\r\n\x85\x1b[31mb",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    await RequestContextMiddleware(app)(scope, receive, send)
    lines = logs.getvalue().splitlines()
    assert len(lines) == 1, lines
    if log_format == "json":
        record = json.loads(lines[0])
        assert record["query"] == "a=\r\n\x85\x1b[31mb" and record["method"] == "GET\r\nX"
    else:
        assert '"GET\\r\\nX /p\\x85\\u2028\\x1b[2J\\rforged?a=\\r\\n\\x85\\x1b[31mb" 204' in lines[0], lines[
            0
        ]


def test_text_format_escapes_any_logger_message_but_keeps_tracebacks(captured_logs):
    logs = captured_logs("text")
    log = logging.getLogger("graphcache.test")
    log.warning("model %s not found", "x\nFAKE ERROR line")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed on %s", "/p\r\n")
    text = logs.getvalue()
    assert "model x\\nFAKE ERROR line not found" in text
    assert "failed on /p\\r\\n" in text
    assert "Traceback (most recent call last)" in text and "ValueError: boom" in text
    assert not any(line.startswith("FAKE") for line in text.splitlines())


async def _post(app, path: str, body: dict, request_id: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post(path, json=body, headers={"X-Request-ID": request_id})


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_a_4xx_access_line_says_why_at_info_with_the_request_id(captured_logs, log_format):
    logs = captured_logs(log_format)
    app = create_app(Settings(), engine=EngineNotNeeded(), metrics=Metrics())
    body = {"model": "m", "prompt": "SECRET-PROMPT-TEXT", "temperature": "hot"}
    response = await _post(app, "/v1/completions", body, "rid-400")
    assert response.status_code == 400
    error = response.json()["error"]
    text = logs.getvalue()
    if log_format == "json":
        records = [json.loads(line) for line in text.splitlines()]
        access = [r for r in records if r["logger"] == "graphcache.access"]
        assert len(access) == 1, records
        assert access[0]["level"] == "info" and access[0]["request_id"] == "rid-400"
        assert access[0]["status"] == 400 and access[0]["param"] == error["param"] == "temperature"
        assert access[0]["reason"] == error["message"] and access[0]["reason"] in access[0]["msg"]
    else:
        lines = access_lines(text)
        assert len(lines) == 1, text
        assert " INFO " in lines[0] and "[rid-400]" in lines[0]
        assert '"POST /v1/completions" 400' in lines[0]
        assert f"refused: {error['message']} (param temperature)" in lines[0]
    assert "SECRET-PROMPT-TEXT" not in text  # the request body is never logged


def test_the_4xx_reason_is_clipped_and_anything_else_is_a_dash():
    from graphcache.api.server.request_log import MAX_REASON_CHARS, refusal_reason

    long_body = json.dumps({"error": {"message": "x" * 10_000, "param": None, "code": "c"}}).encode()
    clipped = refusal_reason(long_body)
    assert len(clipped["reason"]) < MAX_REASON_CHARS + 40 and clipped["code"] == "c"
    assert refusal_reason(b"not json") == {"reason": "-", "param": None, "code": None}
    assert refusal_reason(b'{"error": "flat"}')["reason"] == "-"


async def test_probes_and_scrapes_log_at_debug(captured_logs):
    logs = captured_logs("text")
    app = create_app(Settings(), engine=EngineNotNeeded(), metrics=Metrics())
    for path in ("/health", "/ping", "/version"):
        assert (await _get(app, path)).status_code == 200
    assert access_lines(logs.getvalue()) == []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.post("/health")).status_code == 405
    (refused,) = access_lines(logs.getvalue())  # a refused probe is still said at INFO
    assert '"POST /health" 405' in refused and " INFO " in refused
    logging.getLogger().setLevel("DEBUG")
    assert (await _get(app, "/ping")).status_code == 200
    assert len(access_lines(logs.getvalue())) == 2  # still there for whoever asks for DEBUG


def test_json_logs_drop_uvicorns_colour_copy(captured_logs):
    logs = captured_logs("json")
    logging.getLogger("uvicorn.error").info(
        "Started server process [%d]",
        1,
        extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]"},
    )
    record = json.loads(logs.getvalue())
    assert "color_message" not in record and record["msg"] == "Started server process [1]"


def test_an_image_part_is_named_as_openais_but_not_served_here(caplog, monkeypatch):
    from graphcache.api.openai import body
    from graphcache.api.openai.protocol import ChatMessage
    from pydantic import ValidationError

    monkeypatch.setattr(body, "_unknown_logged", set())
    part = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    with caplog.at_level(logging.WARNING, logger="graphcache.api"), pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "user", "content": [part]})
    (message,) = [r.getMessage() for r in caplog.records if "image_url" in r.getMessage()]
    assert "an OpenAI content part (image input) this server does not support" in message
    assert "neither OpenAI's nor vLLM's" not in message
