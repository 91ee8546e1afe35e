"""Big prompts that are refused in the end must not freeze the server (issue 14, item 1).

Before the fix, eight anonymous clients sending 1 MB prompts (each refused as too long, but only after
tokenizing it) held the interpreter lock ~0.75-2 s per MB: `/health` took seconds and an unrelated
stream stalled for seconds between tokens. Now text longer than `max_model_len * MAX_CHARS_PER_TOKEN`
characters is refused before tokenizing, and tokenization itself runs without the interpreter lock.

The test measures `/health` latency alone (the baseline) and then under a flood of 8 clients sending
big prompts (half far over the character bound, half just under it, so they are tokenized and then
refused by the engine), while one unrelated stream runs. Margins are generous (a busy 2-core CI box)
but far below the old behaviour's seconds.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from graphcache.model.tokenizer import MAX_CHARS_PER_TOKEN

from .support import assert_clean_error

FLOOD_CLIENTS = 8
FLOOD_SECONDS = 4.0
BIG_CHARS = 1_000_000  # under the 1 MiB body limit, with the JSON around it
STREAM_TOKENS = 64
PROBE_INTERVAL_S = 0.02
# Assertion margins (see the module docstring): the old behaviour measured here was 2-17 s at the max.
MAX_HEALTH_S = 1.0  # slowest /health during the flood
P90_FACTOR, P90_FLOOR_S = 25.0, 0.15  # p90 under load < max(25 x baseline p50, 150 ms)
MAX_TOKEN_GAP_S = 1.0  # slowest gap between two events of the unrelated stream


@pytest.fixture(scope="module")
def server_settings():
    return {"max_model_len": 1024}


def _text(chars: int) -> str:
    unit = "The lighthouse keeper writes down every ship that passes the rocks at night. "
    return (unit * (chars // len(unit) + 1))[:chars]


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _probe(base_url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            response = client.get("/health")
            out.append(time.perf_counter() - t0)
            assert response.status_code == 200, response.text
            time.sleep(PROBE_INTERVAL_S)


def _flood(base_url: str, body: bytes, deadline: float, out: list[httpx.Response]) -> None:
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        while time.monotonic() < deadline:
            out.append(
                client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            )


def _stream(base_url: str, stop: threading.Event, out: list[dict]) -> None:
    """Streams of STREAM_TOKENS, one after another until `stop`: each one's status, usage and gaps."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": STREAM_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        while not stop.is_set():
            times, usage, last = [], None, None
            with client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    times.append(time.perf_counter())
                    last = line[6:]
                    if last != "[DONE]":
                        usage = json.loads(last).get("usage") or usage
            out.append(
                {
                    "status": response.status_code,
                    "usage": usage,
                    "last": last,
                    "gaps": [b - a for a, b in zip(times, times[1:], strict=False)],
                }
            )


@pytest.mark.timeout(240)
def test_big_prompt_flood_does_not_freeze_health_or_streams(server):
    max_model_len = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    bound = max_model_len * MAX_CHARS_PER_TOKEN
    over = json.dumps({"prompt": _text(BIG_CHARS), "max_tokens": 4}).encode()
    under = json.dumps({"prompt": _text(bound - 1), "max_tokens": 4}).encode()  # tokenized, then too long
    assert len(over) < 1 << 20

    rejected_before = server.metrics().value("graphcache_requests_rejected_total", reason="invalid")

    # Baseline: /health alone.
    baseline: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=_probe, args=(server.base_url, stop, baseline))
    prober.start()
    time.sleep(1.5)
    stop.set()
    prober.join(30)
    base_p50 = _quantile(baseline, 0.5)

    # The flood, with an unrelated stream and the /health probe beside it.
    loaded: list[float] = []
    responses: list[httpx.Response] = []
    streams: list[dict] = []
    stop, stop_streams = threading.Event(), threading.Event()
    deadline = time.monotonic() + FLOOD_SECONDS
    prober = threading.Thread(target=_probe, args=(server.base_url, stop, loaded))
    streamer = threading.Thread(target=_stream, args=(server.base_url, stop_streams, streams))
    flooders = [
        threading.Thread(
            target=_flood, args=(server.base_url, over if i % 2 == 0 else under, deadline, responses)
        )
        for i in range(FLOOD_CLIENTS)
    ]
    prober.start()
    time.sleep(0.1)
    streamer.start()
    t_flood = time.perf_counter()
    for thread in flooders:
        thread.start()
    for thread in flooders:
        thread.join(180)
    flood_s = time.perf_counter() - t_flood
    stop_streams.set()
    streamer.join(120)
    stop.set()
    prober.join(60)

    max_gap = max((g for st in streams for g in st["gaps"]), default=0.0)
    report = (
        f"/health baseline p50 {base_p50 * 1e3:.1f} ms p99 {_quantile(baseline, 0.99) * 1e3:.1f} ms "
        f"(n={len(baseline)}); under flood p50 {_quantile(loaded, 0.5) * 1e3:.1f} ms p90 "
        f"{_quantile(loaded, 0.9) * 1e3:.1f} ms p99 {_quantile(loaded, 0.99) * 1e3:.1f} ms max "
        f"{max(loaded) * 1e3:.1f} ms (n={len(loaded)}); {len(responses)} big requests in {flood_s:.1f} s; "
        f"{len(streams)} streams beside it, max gap between events {max_gap * 1e3:.1f} ms"
    )
    print(report)

    assert len(responses) >= FLOOD_CLIENTS, report
    for response in responses:
        error = assert_clean_error(response, 400)
        assert error["code"] == "context_length_exceeded", error
    # Refused before reaching the engine's queue: counted as rejections, never as running or waiting.
    rejected = (
        server.metrics().value("graphcache_requests_rejected_total", reason="invalid") - rejected_before
    )
    assert rejected == len(responses), (rejected, len(responses))
    server.wait_idle()
    assert streams, report
    for st in streams:
        assert st["status"] == 200 and st["last"] == "[DONE]", st
        assert st["usage"]["completion_tokens"] == STREAM_TOKENS, st["usage"]

    assert max(loaded) < MAX_HEALTH_S, report
    assert _quantile(loaded, 0.9) < max(P90_FACTOR * base_p50, P90_FLOOR_S), report
    assert max_gap < MAX_TOKEN_GAP_S, report


@pytest.mark.timeout(60)
def test_text_over_the_bound_is_refused_before_tokenizing(server):
    """The 400 names the limit; a 1 MB prompt or chat answers at once (no tokenizing)."""
    max_model_len = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    bound = max_model_len * MAX_CHARS_PER_TOKEN
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client:
        for path, body, param in [
            ("/v1/completions", {"prompt": _text(BIG_CHARS), "max_tokens": 4}, "prompt"),
            (
                "/v1/chat/completions",
                {
                    "messages": [
                        {"role": "user", "content": _text(bound // 2 + 1)},
                        {"role": "user", "content": _text(bound // 2 + 1)},
                    ]
                },
                "messages",
            ),
        ]:
            t0 = time.perf_counter()
            response = client.post(path, json=body)
            seconds = time.perf_counter() - t0
            error = assert_clean_error(response, 400)
            assert error["code"] == "context_length_exceeded" and error["param"] == param, error
            assert str(bound) in error["message"] and str(max_model_len) in error["message"], error
            assert seconds < 2.0, seconds
        # Just under the bound: tokenized, then refused by the engine for its token count.
        response = client.post("/v1/completions", json={"prompt": _text(bound), "max_tokens": 4})
        error = assert_clean_error(response, 400)
        assert error["code"] == "context_length_exceeded", error
        assert "tokens" in error["message"], error
