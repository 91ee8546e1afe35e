"""A full waiting queue: one request runs (max_num_seqs 1), two may wait (max_queue 2), the rest
are told 429 with Retry-After at once, streaming or not. Nobody hangs, the accepted requests finish
exactly, and the server takes new work again once the queue drains."""

from __future__ import annotations

import asyncio
import json
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
    body = completion_body(
        max_tokens=MAX_TOKENS,
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    async with client.stream("POST", "/v1/completions", json=body) as response:
        text = (await response.aread()).decode()
        return response.status_code, dict(response.headers), text, time.perf_counter() - t0


@pytest.mark.timeout(120)
async def test_full_queue_answers_429_with_retry_after_and_never_hangs(server):
    before = server.metrics()
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=60.0, limits=httpx.Limits(max_connections=BURST + 2)
    ) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(client, stream=i % 2 == 0) for i in range(BURST))), timeout=90
        )

    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(accepted) + len(refused) == BURST, [
        (r[0], r[2][:200]) for r in results if r[0] not in (200, 429)
    ]
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
            assert (
                httpx.Response(status, content=text.encode()).json()["usage"]["completion_tokens"]
                == MAX_TOKENS
            )

    after = server.wait_idle(timeout_s=60)
    rejected = after.value("graphcache_requests_rejected_total", reason="queue_full") - before.value(
        "graphcache_requests_rejected_total", reason="queue_full"
    )
    assert rejected == len(refused)


@pytest.mark.timeout(60)
def test_server_takes_work_again_after_the_queue_drains(server):
    server.wait_idle(timeout_s=30)
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        for _ in range(3):
            response = client.post("/v1/completions", json=completion_body(max_tokens=8))
            assert response.status_code == 200, response.text


async def open_and_hold(port: int, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw request left open: it waits in the queue; closing the writer hangs up on it."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    await writer.drain()
    return reader, writer


@pytest.mark.timeout(90)
async def test_clients_leaving_the_queue_free_their_slots(server):
    """Two queued requests whose clients hang up must leave the queue at once: otherwise dead
    requests hold the slots and everyone else gets 429 until they would have run."""
    server.wait_idle(timeout_s=30)
    before = server.metrics()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
        running = asyncio.create_task(one(client, stream=True))  # holds the only running slot for a while
        deadline = time.monotonic() + 20
        while server.metrics().value("graphcache_num_requests_running") < 1:
            assert time.monotonic() < deadline, "the first request never started"
            await asyncio.sleep(0.05)
        held = [await open_and_hold(server.port, completion_body("queued", 8)) for _ in range(MAX_QUEUE)]
        while server.metrics().value("graphcache_num_requests_waiting") < MAX_QUEUE:
            assert time.monotonic() < deadline, "the held requests never queued"
            await asyncio.sleep(0.05)
        full = await client.post("/v1/completions", json=completion_body(max_tokens=8))
        assert full.status_code == 429, "the queue should be full now"

        for _, writer in held:
            writer.close()
        while server.metrics().value("graphcache_num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "hung-up requests still hold their queue slots"
            await asyncio.sleep(0.05)
        newcomers = await asyncio.gather(
            *(client.post("/v1/completions", json=completion_body(max_tokens=8)) for _ in range(MAX_QUEUE))
        )
        assert [r.status_code for r in newcomers] == [200] * MAX_QUEUE, [r.text[:200] for r in newcomers]
        status, _, _, _ = await running
        assert status == 200
    after = server.wait_idle(timeout_s=30)
    aborted = after.value("graphcache_requests_finished_total", reason="abort") - before.value(
        "graphcache_requests_finished_total", reason="abort"
    )
    assert aborted == MAX_QUEUE
