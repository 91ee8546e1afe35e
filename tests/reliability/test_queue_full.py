"""A full waiting queue: one request runs (max_num_seqs 1), two may wait (max_queue 2), the rest
are told 429 with Retry-After at once, streaming or not. Nobody hangs, the accepted requests finish
exactly, and the server takes new work again once the queue drains."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .support import assert_clean_error, completion_body

MAX_NUM_SEQS = 1
MAX_QUEUE = 2
BURST = 14
# Long enough that the first request is still running when the burst's last request arrives.
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def server_settings():
    return {"max_num_seqs": MAX_NUM_SEQS, "max_queue": MAX_QUEUE, "max_num_batched_tokens": 64}


async def one(client: httpx.AsyncClient, stream: bool) -> tuple[int, dict, str, float]:
    """(status, headers, body text, seconds) of one request, the stream read to its end."""
    t0 = time.perf_counter()
    body = completion_body(max_tokens=MAX_TOKENS, stream=stream,
                           **({"stream_options": {"include_usage": True}} if stream else {}))
    async with client.stream("POST", "/v1/completions", json=body) as response:
        text = (await response.aread()).decode()
        return response.status_code, dict(response.headers), text, time.perf_counter() - t0


@pytest.mark.timeout(120)
async def test_full_queue_answers_429_with_retry_after_and_never_hangs(server):
    before = server.metrics()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0,
                                 limits=httpx.Limits(max_connections=BURST + 2)) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(client, stream=i % 2 == 0) for i in range(BURST))), timeout=90)

    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(accepted) + len(refused) == BURST, [(r[0], r[2][:200]) for r in results if r[0] not in (200, 429)]
    assert refused, "a burst of 14 into 1 running + 2 waiting slots must overflow"
    # One may finish while the burst is still arriving, freeing a slot: allow that much slack.
    assert MAX_NUM_SEQS <= len(accepted) <= MAX_NUM_SEQS + MAX_QUEUE + 1, len(accepted)

    for status, headers, text, seconds in refused:
        retry_after = headers.get("retry-after")
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, headers
        error = assert_clean_error(httpx.Response(status, headers=headers, content=text.encode()), 429)
        assert error["type"] == "rate_limit_error"
        assert seconds < 5.0, f"a 429 must be immediate, took {seconds:.1f}s"

    for status, headers, text, _ in accepted:
        if headers.get("content-type", "").startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]"), text[-200:]
            assert f'"completion_tokens": {MAX_TOKENS}' in text or f'"completion_tokens":{MAX_TOKENS}' in text
        else:
            assert httpx.Response(status, content=text.encode()).json()["usage"]["completion_tokens"] == MAX_TOKENS

    after = server.wait_idle(timeout_s=60)
    rejected = (after.value("graphcache_requests_rejected_total", reason="queue_full")
                - before.value("graphcache_requests_rejected_total", reason="queue_full"))
    assert rejected == len(refused)


@pytest.mark.timeout(60)
def test_server_takes_work_again_after_the_queue_drains(server):
    server.wait_idle(timeout_s=30)
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json=completion_body(max_tokens=8))
            assert response.status_code == 200, response.text
